"""The completion rule per mode (pure), and what the planner does with it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from ringwright.objects import Obj
from ringwright.operator.plan.health.completion import Completion, completion
from ringwright.operator.plan.manifests import ROLE_LABEL
from ringwright.operator.plan.pods import PodState, PodView
from ringwright.world import Mode
from tests.unit.operator.test_reconcile import NOW, job, pod, run, world_of

GRACE = 30.0


def worker(index: int, state: PodState, leaving: float | None = None) -> PodView:
    return PodView(name=f"tj-worker-{index}", uid=f"u{index}", role="worker", index=index,
                   state=state, ip="", node="", leaving_since=leaving, restarts=0)


def server(index: int, state: PodState) -> PodView:
    return PodView(name=f"tj-ps-{index}", uid=f"p{index}", role="ps", index=index,
                   state=state, ip="", node="", leaving_since=None, restarts=0)


R, U, S, F, P = (PodState.READY, PodState.UNREADY, PodState.SUCCEEDED, PodState.FAILED,
                 PodState.PENDING)


@dataclass(frozen=True)
class Case:
    name: str
    workers: tuple[PodState, ...]
    servers: tuple[PodState, ...]
    since: float | None
    succeeded: bool
    finishing: bool
    finished_at: float | None = None


CASES = [
    Case("all training", (R, R), (R, R), None, False, False),
    Case("a worker failed: lost, not finished", (F, R), (R, R), None, False, False),
    Case("one finished, one still training", (S, R), (R, R), None, False, True),
    Case("one finished, one unready but running", (S, U), (R, R), None, False, True),
    Case("all finished, servers exited", (S, S), (S, S), None, True, False, NOW),
    Case("all finished, servers lingering", (S, S), (R, S), None, False, True, NOW),
    Case("servers lingering within the grace", (S, S), (R, R), NOW - GRACE + 1, False, True,
         NOW - GRACE + 1),
    Case("servers past the grace are deleted", (S, S), (R, R), NOW - GRACE, True, False,
         NOW - GRACE),
    Case("a never-started worker is not waited for", (S, P), (S, S), None, True, False, NOW),
    Case("a server done first: the workers follow", (R, R), (S, R), None, False, True),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_parameter_server_completion(case: Case) -> None:
    workers = [worker(i, s) for i, s in enumerate(case.workers)]
    servers = [server(i, s) for i, s in enumerate(case.servers)]
    got = completion(Mode.PARAMETER_SERVER, world_of([0, 1]), workers, servers, case.since,
                     NOW, GRACE)
    assert (got.succeeded, got.finishing, got.workers_finished_at) == \
        (case.succeeded, case.finishing, case.finished_at)


def test_a_worker_that_left_on_a_scale_down_is_not_finished() -> None:
    workers = [worker(0, S, leaving=NOW - 5), worker(1, R)]
    got = completion(Mode.PARAMETER_SERVER, world_of([1]), workers, [server(0, R)], None,
                     NOW, GRACE)
    assert got == Completion()


def test_lingering_servers_ask_to_be_checked_when_the_grace_ends() -> None:
    got = completion(Mode.PARAMETER_SERVER, None, [worker(0, S)], [server(0, R)],
                     NOW - 10, NOW, GRACE)
    assert got.wait == pytest.approx(GRACE - 10)


@pytest.mark.parametrize(("states", "succeeded", "finishing"), [
    ((S, R), True, False),
    ((R, S), False, True),  # rank 1 ended first: done, not lost; rank 0 follows
    ((R, R), False, False),
    ((R, F), False, False),
])
def test_ring_mode_completes_when_rank0_exits_0(states: tuple[PodState, ...],
                                                succeeded: bool, finishing: bool) -> None:
    workers = [worker(i, s) for i, s in enumerate(states)]
    got = completion(Mode.ALL_REDUCE, world_of([0, 1]), workers, [], None, NOW, GRACE)
    assert (got.succeeded, got.finishing) == (succeeded, finishing)


def test_planner_does_not_replace_a_ring_member_that_finished_before_rank0() -> None:
    result = run(job(replicas=2, minimum=2, status={"phase": "Running"}),
                 pods=[pod(0), pod(1, phase="Succeeded")], world=world_of([0, 1]))
    assert result.create == [] and result.world is None
    assert result.status["phase"] == "Running"


def ps_job(status: Obj) -> Obj:
    container = [{"name": "ps", "image": "img"}]
    return job(replicas=2, minimum=2, status=status, mode="ParameterServer",
               ps={"replicas": 2, "template": {"spec": {"containers": container}}})


def ps_pod(index: int, phase: str = "Running") -> Obj:
    body = pod(index, phase=phase)
    body["metadata"]["name"] = f"tj-ps-{index}"
    body["metadata"]["uid"] = f"p{index}"
    body["metadata"]["labels"][ROLE_LABEL] = "ps"
    return body


def test_planner_neither_replaces_a_finished_worker_nor_goes_below_min() -> None:
    pods = [pod(0, phase="Succeeded"), pod(1), ps_pod(0), ps_pod(1)]
    result = run(ps_job({"phase": "Running"}), pods=pods, world=world_of([0, 1]))
    assert result.create == [] and result.delete == [] and result.world is None
    assert result.status["phase"] == "Running"
    assert result.status.get("restarts", 0) == 0


def test_planner_waits_for_the_servers_then_succeeds() -> None:
    pods = [pod(0, phase="Succeeded"), pod(1, phase="Succeeded"), ps_pod(0), ps_pod(1)]
    waiting = run(ps_job({"phase": "Running"}), pods=pods, world=world_of([0, 1]))
    assert waiting.status["phase"] == "Running" and waiting.create == []
    assert waiting.status["workersFinishedTime"]
    assert waiting.requeue_after is not None
    exited = [pod(0, phase="Succeeded"), pod(1, phase="Succeeded"),
              ps_pod(0, phase="Succeeded"), ps_pod(1, phase="Succeeded")]
    done = run(ps_job(waiting.status), pods=exited, world=world_of([0, 1]), now=NOW + 1)
    assert done.status["phase"] == "Succeeded" and done.delete == []


def test_planner_deletes_servers_that_outstay_the_grace() -> None:
    pods = [pod(0, phase="Succeeded"), pod(1, phase="Succeeded"), ps_pod(0), ps_pod(1)]
    waiting = run(ps_job({"phase": "Running"}), pods=pods, world=world_of([0, 1]))
    late = run(ps_job(waiting.status), pods=pods, world=world_of([0, 1]), now=NOW + 31)
    assert late.status["phase"] == "Succeeded"
    assert sorted(late.delete) == ["tj-ps-0", "tj-ps-1"]
