"""Table-style tests of the pure planner: observed state in, plan data out."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import pytest

from ringwright.objects import Obj
from ringwright.operator.api.conditions import rfc3339
from ringwright.operator.api.models import JobPhase, TrainingJobSpec
from ringwright.operator.api.schedulingpolicy import SchedulingPolicySpec
from ringwright.operator.plan.manifests import (
    INDEX_LABEL,
    JOB_LABEL,
    LEAVING_ANNOTATION,
    PLANNED_NODE_ANNOTATION,
    ROLE_LABEL,
)
from ringwright.operator.plan.phases import TRANSITIONS, IllegalTransition, check_transition
from ringwright.operator.plan.placement.inventory import Inventory, NodeInfo
from ringwright.operator.plan.placement.resources import Resources
from ringwright.operator.plan.pods import PodView
from ringwright.operator.plan.reconcile import Observed, Placement, backoff, plan
from ringwright.operator.settings import OperatorSettings
from ringwright.world import JobRef, Member, Report, ReportKind, StoreAddress, World

NOW = 1_000_000.0
SETTINGS = OperatorSettings(settle_seconds=2, drain_seconds=30, below_min_grace_seconds=60,
                            backoff_base_seconds=1, backoff_cap_seconds=8)
NODES = Inventory(tuple(
    NodeInfo(name=f"rack-{r}-node-{n}", rack=f"rack-{r}", nvlink_domain=f"rack-{r}-nvl-0",
             gpu_model="H100")
    for r in range(2) for n in range(2)))


def job(replicas: int = 4, minimum: int = 2, status: Obj | None = None, **spec: Any) -> Obj:
    body: Obj = {
        "apiVersion": "ringwright.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "tj", "namespace": "ns", "uid": "uid-tj", "generation": 3},
        "spec": {"workers": {"min": minimum, "replicas": replicas, "template": {
            "spec": {"containers": [{"name": "train", "image": "img"}]}}}, **spec},
    }
    if status is not None:
        body["status"] = status
    return body


def pod(index: int, phase: str = "Running", ready: bool = True, uid: str = "",
        node: str = "rack-0-node-0", leaving: float | None = None) -> Obj:
    annotations = {LEAVING_ANNOTATION: str(leaving)} if leaving is not None else {}
    return {
        "metadata": {"name": f"tj-worker-{index}", "uid": uid or f"u{index}",
                     "labels": {JOB_LABEL: "tj", ROLE_LABEL: "worker", INDEX_LABEL: str(index)},
                     "annotations": annotations},
        "spec": {"nodeName": node},
        "status": {"phase": phase, "podIP": f"127.10.0.{index + 1}" if phase == "Running" else "",
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def world_of(indices: Sequence[int], generation: int = 1) -> World:
    members = tuple(Member(rank=r, pod=f"tj-worker-{i}", pod_uid=f"u{i}", ip=f"127.10.0.{i + 1}")
                    for r, i in enumerate(indices))
    return World(job=JobRef(namespace="ns", name="tj"), generation=generation,
                 store=StoreAddress(address=members[0].ip), members=members)


class FakePlacer:
    """Places every missing worker on rack-0 unless told the cluster is full."""

    def __init__(self, room: int = 100, reason: str = "") -> None:
        self.room, self.reason, self.calls = room, reason, 0

    def __call__(self, spec: TrainingJobSpec, policy: SchedulingPolicySpec, inventory: Inventory,
                 live: Sequence[PodView]) -> Placement:
        self.calls += 1
        if self.reason:
            return Placement(reason="Unschedulable", message=self.reason)
        alive = sum(1 for p in live if p.role == "worker")
        want = min(spec.workers.replicas - alive, self.room)
        fragment = {"priorityClassName": "ringwright-worker"}
        return Placement(workers=[copy.deepcopy(fragment) for _ in range(want)],
                         gpu_model="H100", summary=f"{want} x H100")


def run(body: Obj, pods: Sequence[Obj] = (), world: World | None = None,
        reports: dict[str, Report] | None = None, policy: bool = True, now: float = NOW,
        placer: FakePlacer | None = None, hold: float | None = None,
        world_version: str = "", published: float | None = None) -> Any:
    observed = Observed(job=body, pods=pods, world=world, reports=reports or {},
                        policy=SchedulingPolicySpec() if policy else None, inventory=NODES,
                        hold_creates_until=hold, world_version=world_version,
                        world_published_at=published)
    return plan(observed, SETTINGS, now, placer or FakePlacer())


def test_new_job_creates_all_workers_with_labels_env_and_owner() -> None:
    result = run(job())
    names = [p["metadata"]["name"] for p in result.create]
    assert names == [f"tj-worker-{i}" for i in range(4)]
    first = result.create[0]
    assert first["metadata"]["ownerReferences"][0]["uid"] == "uid-tj"
    assert first["spec"]["priorityClassName"] == "ringwright-worker"
    env = {e["name"]: e for e in first["spec"]["containers"][0]["env"]}
    assert {"RINGWRIGHT_JOB_NAME", "RINGWRIGHT_POD_IP", "RINGWRIGHT_WORLD_CONFIGMAP"} <= set(env)
    # A process of a deleted pod knows it is not its namesake's successor.
    assert env["RINGWRIGHT_POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
    assert result.world is None
    assert result.status["phase"] == "Pending"
    assert result.status["observedGeneration"] == 3


def test_all_ready_publishes_first_world_and_runs() -> None:
    result = run(job(), pods=[pod(i) for i in range(4)])
    assert result.world is not None and result.world.generation == 1 and result.world.size == 4
    assert result.status["phase"] == "Running"
    assert result.status["world"]["size"] == 4
    assert [e.reason for e in result.events] == ["WorldPublished", "Running"]


def test_the_status_names_the_gpu_model_the_world_runs_on() -> None:
    # A round that read the pods index before it held the previous round's creates
    # planned the "missing" pods on another model; its creates were refused as
    # AlreadyExists but its status change stayed.
    stale = run(job()).status
    stale["world"]["gpuModel"] = "A100"
    result = run(job(status=stale), pods=[pod(i) for i in range(4)])
    assert result.world is not None
    assert {m.gpu_model for m in result.world.members} == {"H100"}
    assert result.status["world"]["gpuModel"] == "H100"


def test_partial_membership_waits_for_settle_window_then_publishes_once() -> None:
    pods = [pod(i) for i in range(3)] + [pod(3, phase="Pending")]
    first = run(job(), pods=pods)
    assert first.world is None
    assert first.requeue_after == pytest.approx(2)
    again = run(job(status=first.status), pods=pods, now=NOW + 1)
    assert again.world is None
    settled = run(job(status=again.status), pods=pods, now=NOW + 2.5)
    assert settled.world is not None and settled.world.size == 3


def test_deleted_member_counts_one_restart_and_is_replaced_after_backoff() -> None:
    running = {"phase": "Running", "restarts": 0}
    pods = [pod(i) for i in (0, 1, 3)]
    lost = run(job(status=running), pods=pods, world=world_of([0, 1, 2, 3]))
    assert lost.status["restarts"] == 1
    assert any(e.reason == "MemberLost" for e in lost.events)
    assert lost.create == []  # backoff: not yet
    again = run(job(status=lost.status), pods=pods, world=world_of([0, 1, 2, 3]), now=NOW + 0.5)
    assert again.status["restarts"] == 1  # counted once
    later = run(job(status=lost.status), pods=pods, world=world_of([0, 1, 2, 3]), now=NOW + 2)
    assert [p["metadata"]["name"] for p in later.create] == ["tj-worker-2"]


def test_the_backoff_grows_with_failures_in_a_row_and_starts_over_once_the_job_is_whole(
) -> None:
    # Many failures in the job's life, the last ones in a row: the replacement waits
    # the cap (8 s here), not the base delay.
    def long_job(status: Obj) -> Obj:
        return job(status=status, runPolicy={"backoffLimit": 100})

    looping = {"phase": "Running", "restarts": 40, "failuresSinceWhole": 4}
    pods = [pod(i) for i in (0, 1, 3)]
    lost = run(long_job(status=looping), pods=pods, world=world_of([0, 1, 2, 3]))
    assert lost.status["restarts"] == 41 and lost.status["failuresSinceWhole"] == 5
    assert run(long_job(status=lost.status), pods=pods, world=world_of([0, 1, 2, 3]),
               now=NOW + 7).create == []
    replaced = run(long_job(status=lost.status), pods=pods, world=world_of([0, 1, 2, 3]),
                   now=NOW + 8)
    assert [p["metadata"]["name"] for p in replaced.create] == ["tj-worker-2"]
    # The replacement joins: a world of all four resets the count ...
    whole = [pod(0), pod(1), pod(2, uid="u2-new"), pod(3)]
    rejoined = run(long_job(status=replaced.status), pods=whole, world=world_of([0, 1, 3]),
                   reports=joining(2, 1), now=NOW + 20)
    assert rejoined.world is not None and rejoined.world.size == 4
    assert rejoined.status["failuresSinceWhole"] == 0 and rejoined.status["restarts"] == 41
    # ... so the next loss, however many came before, waits the base delay (1 s).
    again = run(long_job(status=rejoined.status), pods=pods, world=rejoined.world,
                now=NOW + 30)
    assert again.status["failuresSinceWhole"] == 1 and again.create == []
    soon = run(long_job(status=again.status), pods=pods, world=rejoined.world, now=NOW + 31)
    assert [p["metadata"]["name"] for p in soon.create] == ["tj-worker-2"]
    # A world short of a worker does not reset it.
    short = run(long_job(status=lost.status), pods=pods, world=world_of([0, 1, 3]), now=NOW + 20)
    assert short.status["failuresSinceWhole"] == 5


def test_failed_pod_is_deleted_and_counted() -> None:
    pods = [pod(0), pod(1, phase="Failed")]
    result = run(job(replicas=2, minimum=1, status={"phase": "Running"}), pods=pods,
                 world=world_of([0, 1]))
    assert result.delete == ["tj-worker-1"]
    assert result.status["restarts"] == 1


def test_backoff_limit_exceeded_fails_the_job() -> None:
    status = {"phase": "Running", "restarts": 6}
    result = run(job(status=status), pods=[pod(i) for i in range(3)],
                 world=world_of([0, 1, 2, 3]))
    assert result.status["phase"] == "Failed"
    assert any(c["reason"] == "BackoffLimitExceeded" for c in result.status["conditions"])


def test_scale_down_marks_highest_ranks_leaving_and_publishes_without_them() -> None:
    pods = [pod(i) for i in range(4)]
    result = run(job(replicas=2, status={"phase": "Running"}), pods=pods,
                 world=world_of([0, 1, 2, 3]))
    assert sorted(result.mark_leaving) == ["tj-worker-2", "tj-worker-3"]
    assert result.delete == []
    assert result.world is not None
    assert [m.pod for m in result.world.members] == ["tj-worker-0", "tj-worker-1"]


def test_leaving_pod_is_deleted_once_it_exits_or_drain_expires() -> None:
    status = {"phase": "Running"}
    pods = [pod(0), pod(1), pod(2, phase="Succeeded", leaving=NOW - 1), pod(3, leaving=NOW - 5)]
    result = run(job(replicas=2, status=status), pods=pods, world=world_of([0, 1], generation=2))
    assert result.delete == ["tj-worker-2"]
    expired = run(job(replicas=2, status=status), pods=pods, world=world_of([0, 1], generation=2),
                  now=NOW + 40)
    assert sorted(expired.delete) == ["tj-worker-2", "tj-worker-3"]


def test_scale_up_adds_lowest_free_indices() -> None:
    pods = [pod(0), pod(2)]
    result = run(job(replicas=4, status={"phase": "Running"}), pods=pods, world=world_of([0, 2]))
    assert [p["metadata"]["name"] for p in result.create] == ["tj-worker-1", "tj-worker-3"]


def test_rank0_success_completes_and_gives_the_other_members_a_grace_to_exit() -> None:
    # Member 1 still runs its last step; worker 2 is a replacement that never joined.
    pods = [pod(0, phase="Succeeded"), pod(1), pod(2, phase="Pending")]
    result = run(job(replicas=3, minimum=1, status={"phase": "Running"}), pods=pods,
                 world=world_of([0, 1]))
    assert result.status["phase"] == "Succeeded"
    assert result.delete == ["tj-worker-2"]
    grace = SETTINGS.rank_exit_grace_seconds
    assert result.requeue_after == pytest.approx(grace)

    still = run(job(replicas=3, minimum=1, status=result.status), pods=pods[:2],
                world=world_of([0, 1]), now=NOW + grace - 1)
    assert still.delete == [] and still.requeue_after == pytest.approx(1)
    late = run(job(replicas=3, minimum=1, status=result.status), pods=pods[:2],
               world=world_of([0, 1]), now=NOW + grace)
    assert late.delete == ["tj-worker-1"]


def test_a_member_that_exited_after_rank0_leaves_nothing_to_wait_for() -> None:
    status = {"phase": "Succeeded", "completionTime": "1970-01-12T13:46:40Z"}
    result = run(job(replicas=2, minimum=1, status=status),
                 pods=[pod(0, phase="Succeeded"), pod(1, phase="Succeeded")],
                 world=world_of([0, 1]), now=NOW + 1)
    assert result.delete == [] and result.requeue_after is None


def test_a_failed_job_deletes_its_running_members_at_once() -> None:
    status = {"phase": "Failed", "completionTime": "1970-01-12T13:46:40Z"}
    result = run(job(replicas=2, minimum=1, status=status), pods=[pod(0), pod(1)],
                 world=world_of([0, 1]), now=NOW + 1)
    assert sorted(result.delete) == ["tj-worker-0", "tj-worker-1"]


def test_ttl_after_finished_deletes_the_job() -> None:
    status = {"phase": "Succeeded", "completionTime": "1970-01-12T13:46:40Z"}
    body = job(status=status, runPolicy={"ttlSecondsAfterFinished": 10})
    assert not run(body, now=NOW + 5).delete_job
    assert run(body, now=NOW + 10).delete_job


def test_suspend_empties_the_world_deletes_gracefully_and_resume_loses_nobody() -> None:
    pods = [pod(i) for i in range(8)]
    running = {"phase": "Running", "restarts": 2, "world": {"generation": 4}}
    body = job(replicas=8, status=running, runPolicy={"suspend": True, "backoffLimit": 2})
    suspended = run(body, pods=pods, world=world_of(range(8), generation=4), world_version="41")
    # Members learn they are out from an empty world, then get their own grace period.
    assert suspended.world is not None and suspended.world.generation == 5
    assert suspended.world_version == "41"  # written over the world it replaces
    assert suspended.world.members == ()
    assert sorted(suspended.delete_gracefully) == sorted(f"tj-worker-{i}" for i in range(8))
    assert suspended.delete == []
    st = suspended.status
    assert st["phase"] == "Suspended" and st["restarts"] == 2
    assert st["world"]["generation"] == 5 and st["world"]["size"] == 0
    assert [h["phase"] for h in st["phaseHistory"]] == ["Suspended"]
    assert {"WorldPublished", "Suspended"} <= {e.reason for e in suspended.events}
    assert not any(e.type == "Warning" for e in suspended.events)

    # Resumed with no pods left: the empty world has no member to lose.
    resumed = run(job(replicas=8, status=st, runPolicy={"backoffLimit": 2}),
                  world=suspended.world, now=NOW + 60)
    assert resumed.status["phase"] == "Pending" and resumed.status["restarts"] == 2
    assert len(resumed.create) == 8
    assert not any(e.reason == "MemberLost" for e in resumed.events)
    assert [h["phase"] for h in resumed.status["phaseHistory"]] == ["Suspended", "Pending"]


def test_missing_policy_is_a_condition_not_a_crash() -> None:
    result = run(job(), policy=False)
    cond = next(c for c in result.status["conditions"] if c["type"] == "PolicyFound")
    assert cond["status"] == "False" and cond["reason"] == "PolicyNotFound"
    assert "default" in cond["message"]
    assert result.create == []


def test_gang_rule_creates_nothing_when_min_does_not_fit() -> None:
    result = run(job(), placer=FakePlacer(reason="needs 4 x H100 within 1 rack; best has 2"))
    assert result.create == []
    cond = next(c for c in result.status["conditions"] if c["type"] == "Schedulable")
    assert cond["status"] == "False" and "needs 4" in cond["message"]


def test_a_job_without_room_waits_for_room_and_one_placed_does_not() -> None:
    # What the operator keys its wake-ups on: a job that found no room (gang rule, or
    # only part of what is missing placed) is woken when another job's pod frees some.
    assert run(job(), placer=FakePlacer(reason="needs 4 x H100")).waits_for_room
    assert run(job(), placer=FakePlacer(room=1)).waits_for_room
    assert not run(job()).waits_for_room


def test_deadline_exceeded_fails() -> None:
    status = {"phase": "Running", "startTime": "1970-01-12T13:46:40Z"}
    body = job(status=status, runPolicy={"activeDeadlineSeconds": 100})
    result = run(body, pods=[pod(i) for i in range(4)], now=NOW + 100)
    assert result.status["phase"] == "Failed"


def test_below_min_too_long_fails_with_reason() -> None:
    pods = [pod(0)]
    first = run(job(status={"phase": "Running", "restarts": 0}), pods=pods,
                world=world_of([0, 1, 2, 3]), placer=FakePlacer(room=0))
    assert first.status["phase"] == "Restarting"
    later = run(job(status=first.status), pods=pods, world=world_of([0, 1, 2, 3]),
                now=NOW + 61, placer=FakePlacer(room=0))
    assert later.status["phase"] == "Failed"


def test_collective_failure_without_a_verdict_bumps_the_generation_with_same_members() -> None:
    pods = [pod(i) for i in range(4)]
    report = Report(kind=ReportKind.COLLECTIVE_FAILED, generation=4, at=NOW)
    waiting = run(job(status={"phase": "Running"}), pods=pods,
                  world=world_of(range(4), generation=4), reports={"tj-worker-1": report})
    assert waiting.world is None, "the heartbeats may still name a dead member"
    assert waiting.requeue_after is not None
    result = run(job(status={"phase": "Running"}), pods=pods,
                 world=world_of(range(4), generation=4), reports={"tj-worker-1": report},
                 now=NOW + 10)
    assert result.world is not None and result.world.generation == 5
    assert result.world.size == 4
    stale = run(job(status={"phase": "Running"}), pods=pods, world=world_of(range(4), generation=5),
                reports={"tj-worker-1": report}, now=NOW + 10)
    assert stale.world is None


def test_a_member_restarted_without_state_bumps_the_generation_at_once() -> None:
    pods = [pod(i) for i in range(4)]
    report = Report(kind=ReportKind.NO_STATE, generation=4, at=NOW)
    result = run(job(status={"phase": "Running"}), pods=pods,
                 world=world_of(range(4), generation=4), reports={"tj-worker-1": report})
    assert result.world is not None and result.world.generation == 5 and result.world.size == 4


def dead(*suspects: str) -> Report:
    return Report(kind=ReportKind.PEER_DEAD, generation=4, at=NOW, suspects=suspects)


def test_a_member_its_peers_found_dead_is_replaced() -> None:
    pods = [pod(i) for i in range(4)]
    reports = {"tj-worker-0": dead("tj-worker-2"), "tj-worker-3": dead("tj-worker-2")}
    result = run(job(status={"phase": "Running"}), pods=pods,
                 world=world_of(range(4), generation=4), reports=reports)
    assert result.delete == ["tj-worker-2"]
    assert any(e.reason == "MemberDead" for e in result.events)
    assert result.world is None or "tj-worker-2" not in [m.pod for m in result.world.members]


def restarted(index: int, count: int, at: float) -> Obj:
    """A Ready worker whose training container restarted ``count`` times, last at ``at``."""
    body = pod(index)
    body["spec"]["containers"] = [{"name": "train", "image": "img"}]
    body["status"]["containerStatuses"] = [{"name": "train", "restartCount": count, "state": {
        "running": {"startedAt": rfc3339(at)}}}]
    return body


TWO_ACCUSE_2 = {"tj-worker-0": dead("tj-worker-2"), "tj-worker-3": dead("tj-worker-2")}


def restart_then_verdict(restart_at: float) -> tuple[Any, Any]:
    """Rounds of a world written at NOW - 10: worker 2's container restarted at
    ``restart_at``, then two peers name it dead. The two rounds' plans."""
    pods = [pod(0), pod(1), restarted(2, 1, restart_at), pod(3)]
    first = run(job(status={"phase": "Running"}), pods=pods,
                world=world_of(range(4), generation=4), published=NOW - 10)
    assert first.status["restarts"] == 1
    verdict = run(job(status=first.status), pods=pods, world=world_of(range(4), generation=4),
                  reports=TWO_ACCUSE_2, published=NOW - 10)
    return first, verdict


def test_one_sigkill_counts_once_whether_the_restart_or_the_verdict_is_seen_first() -> None:
    # The container restarted after the world was written; its peers then name the
    # process that died: one failure, counted by the restart alone.
    reports = TWO_ACCUSE_2
    pods = [pod(0), pod(1), restarted(2, 1, NOW - 2), pod(3)]
    _, verdict = restart_then_verdict(NOW - 2)
    assert verdict.status["restarts"] == 1
    assert any(e.reason == "MemberDead" and "counted once" in e.message
               for e in verdict.events)
    # Both seen in one round: still one.
    once = run(job(status={"phase": "Running"}), pods=pods,
               world=world_of(range(4), generation=4), reports=reports, published=NOW - 10)
    assert once.status["restarts"] == 1
    # The verdict first: the pod is counted lost; its container restarting before the
    # deletion lands is the same failure.
    alive = [pod(i) for i in range(4)]
    judged = run(job(status={"phase": "Running"}), pods=alive,
                 world=world_of(range(4), generation=4), reports=reports, published=NOW - 10)
    assert judged.status["restarts"] == 1
    later = run(job(status=judged.status), pods=pods, world=world_of(range(4), generation=4),
                published=NOW - 10)
    assert later.status["restarts"] == 1


def test_a_member_whose_container_restarted_leaves_the_world_and_joins_again() -> None:
    # The kubelet already started the killed process again in its pod: the pod is kept,
    # the survivors go on without it, and its new process enters as a newcomer.
    reports = {f"tj-worker-{i}": dead("tj-worker-2") for i in (0, 1, 3)}
    pods = [pod(0), pod(1), restarted(2, 1, NOW - 2), pod(3)]
    verdict = run(job(status={"phase": "Running"}), pods=pods,
                  world=world_of(range(4), generation=4), reports=reports, published=NOW - 10)
    assert verdict.delete == [] and verdict.create == []
    assert verdict.world is not None and verdict.world.generation == 5
    assert [m.pod for m in verdict.world.members] == ["tj-worker-0", "tj-worker-1",
                                                      "tj-worker-3"]
    assert verdict.status["restarts"] == 1 and "tj-worker-2/u2" not in verdict.status.get(
        "lostPods", [])
    # Ready, but its new process has not asked in: the world stays as it is.
    waiting = run(job(status=verdict.status), pods=pods, world=verdict.world,
                  published=NOW + 1, now=NOW + 5)
    assert waiting.world is None and waiting.delete == [] and waiting.create == []
    # It asks to join the world it is not in: it enters, and nothing more was counted.
    joined = run(job(status=verdict.status), pods=pods, world=verdict.world,
                 reports=joining(2, 5), published=NOW + 1, now=NOW + 6)
    assert joined.world is not None and joined.world.size == 4
    assert joined.status["restarts"] == 1
    # Lost for another reason as well (its node is gone): replaced after all.
    failed = [pod(0), pod(1), restarted(2, 1, NOW - 2), pod(3)]
    failed[2]["status"]["phase"] = "Failed"
    replaced = run(job(status={"phase": "Running"}), pods=failed,
                   world=world_of(range(4), generation=4), reports=reports, published=NOW - 10)
    assert replaced.delete == ["tj-worker-2"]


def counted_world(restarts: dict[int, int]) -> World:
    """Generation 4 of workers 0-3, as this operator writes it: with each pod's container
    restarts when it was written."""
    base = world_of(range(4), generation=4)
    return base.model_copy(update={"members": tuple(
        m.model_copy(update={"restarts": restarts.get(i, 0)})
        for i, m in enumerate(base.members))})


def test_a_restart_within_the_second_of_the_write_is_told_by_the_worlds_count() -> None:
    # Killed 0.3 s after the world was written, started again at once: the container's
    # start reads as the whole second before the write, but the world's count shows the
    # restart. The pod is kept and the failure counted once.
    pods = [pod(0), pod(1), restarted(2, 1, NOW - 0.2), pod(3)]
    verdict = run(job(status={"phase": "Running"}), pods=pods, world=counted_world({}),
                  reports=TWO_ACCUSE_2, published=NOW - 0.5)
    assert verdict.delete == [] and verdict.create == []
    assert any(e.reason == "MemberDead" and "joins again" in e.message
               for e in verdict.events), verdict.events
    assert verdict.status["restarts"] == 1
    # Without the count (an older operator's world) the same start reads as before the
    # write: the pod is replaced.
    old = run(job(status={"phase": "Running"}), pods=pods,
              world=world_of(range(4), generation=4), reports=TWO_ACCUSE_2,
              published=NOW - 0.5)
    assert old.delete == ["tj-worker-2"]
    # Restarted before the world was written (the count says so), then dead again: a
    # second failure, and the pod is replaced whatever the clocks say.
    again = run(job(status={"phase": "Running", "containerRestarts": {"tj-worker-2/u2": 1},
                           "restarts": 1}),
                pods=pods, world=counted_world({2: 1}), reports=TWO_ACCUSE_2,
                published=NOW - 10)
    assert again.delete == ["tj-worker-2"] and again.status["restarts"] == 2


def test_the_world_records_each_members_container_restarts() -> None:
    pods = [pod(0), pod(1), restarted(2, 3, NOW - 50), pod(3)]
    result = run(job(status={"phase": "Running", "containerRestarts": {"tj-worker-2/u2": 3},
                            "restarts": 3}), pods=pods)
    assert result.world is not None
    assert {m.pod: m.restarts for m in result.world.members} == {
        "tj-worker-0": 0, "tj-worker-1": 0, "tj-worker-2": 3, "tj-worker-3": 0}
    assert '"restarts":3' in result.world.to_json().replace(" ", "")


def test_a_restart_before_the_world_was_written_and_a_later_death_are_two_failures() -> None:
    first, verdict = restart_then_verdict(NOW - 20)
    assert verdict.status["restarts"] == 2
    # Nor is a world of unknown age (an older operator wrote it) taken for a restart.
    unknown = run(job(status=first.status), pods=[pod(0), pod(1), restarted(2, 1, NOW - 2),
                                                  pod(3)],
                  world=world_of(range(4), generation=4), reports=TWO_ACCUSE_2)
    assert unknown.status["restarts"] == 2


def test_survivors_that_all_wait_get_the_next_world_without_the_settle_window() -> None:
    pods = [pod(i) for i in range(4)]
    failed = Report(kind=ReportKind.COLLECTIVE_FAILED, generation=4, at=NOW)
    waiting = {"tj-worker-0": dead("tj-worker-2"), "tj-worker-1": failed,
               "tj-worker-3": dead("tj-worker-2")}
    result = run(job(status={"phase": "Running"}), pods=pods,
                 world=world_of(range(4), generation=4), reports=waiting)
    assert result.delete == ["tj-worker-2"]
    assert result.world is not None and result.world.generation == 5
    assert [m.pod for m in result.world.members] == ["tj-worker-0", "tj-worker-1", "tj-worker-3"]
    # One survivor still trains (no report): the settle window holds the world back.
    partial = {k: v for k, v in waiting.items() if k != "tj-worker-1"}
    held = run(job(status={"phase": "Running"}), pods=pods, world=world_of(range(4), generation=4),
               reports=partial)
    assert held.delete == ["tj-worker-2"] and held.world is None
    assert held.status["candidate"] is not None  # waiting out the window


def test_one_accuser_is_not_enough_unless_the_pod_is_unready_too() -> None:
    reports = {"tj-worker-3": dead("tj-worker-0", "tj-worker-1", "tj-worker-2")}
    healthy = run(job(status={"phase": "Running"}), pods=[pod(i) for i in range(4)],
                  world=world_of(range(4), generation=4), reports=reports)
    assert healthy.delete == []
    unready = [pod(i, ready=i != 1) for i in range(4)]
    result = run(job(status={"phase": "Running"}), pods=unready,
                 world=world_of(range(4), generation=4), reports=reports)
    assert result.delete == ["tj-worker-1"]


def test_stalled_member_is_deleted_and_its_report_cleared() -> None:
    pods = [pod(i) for i in range(4)]
    report = Report(kind=ReportKind.STALLED, generation=1, at=NOW)
    result = run(job(status={"phase": "Running"}), pods=pods, world=world_of(range(4)),
                 reports={"tj-worker-2": report})
    assert result.delete == ["tj-worker-2"]
    assert result.clear_reports == ["tj-worker-2"]
    # The next world is debounced; once the settle window has passed (the deletion seen
    # as a deletionTimestamp), it is published without the stalled member.
    assert result.world is None
    pods[2]["metadata"]["deletionTimestamp"] = "1970-01-12T13:46:40Z"
    settled = run(job(status=result.status), pods=pods, world=world_of(range(4)),
                  now=NOW + SETTINGS.settle_seconds)
    assert settled.world is not None and settled.world.generation == 2
    assert [m.pod for m in settled.world.members] == ["tj-worker-0", "tj-worker-1",
                                                      "tj-worker-3"]


P = JobPhase
LIFECYCLE = {
    # Written out here, not read from the table under test: the lifecycle as specified.
    (P.PENDING, P.RUNNING), (P.PENDING, P.FAILED), (P.PENDING, P.SUSPENDED),
    (P.PENDING, P.SUCCEEDED),
    (P.RUNNING, P.RESTARTING), (P.RUNNING, P.SUCCEEDED), (P.RUNNING, P.FAILED),
    (P.RUNNING, P.SUSPENDED),
    (P.RESTARTING, P.RUNNING), (P.RESTARTING, P.FAILED), (P.RESTARTING, P.SUSPENDED),
    (P.RESTARTING, P.SUCCEEDED),
    (P.SUSPENDED, P.PENDING), (P.SUSPENDED, P.FAILED),
}
"""Allowed changes of phase; Succeeded and Failed are final; staying put is always fine."""


@pytest.mark.parametrize("current", list(JobPhase))
@pytest.mark.parametrize("nxt", list(JobPhase))
def test_phase_table(current: JobPhase, nxt: JobPhase) -> None:
    if nxt == current or (current, nxt) in LIFECYCLE:
        assert check_transition(current, nxt) == nxt
    else:
        with pytest.raises(IllegalTransition):
            check_transition(current, nxt)


def test_phase_table_matches_the_lifecycle() -> None:
    assert {(a, b) for a, nxt in TRANSITIONS.items() for b in nxt} == LIFECYCLE


@pytest.mark.parametrize(("restarts", "expected"), [(0, 1), (1, 1), (2, 2), (3, 4), (10, 8)])
def test_backoff_doubles_up_to_cap(restarts: int, expected: float) -> None:
    assert backoff(restarts, 1, 8) == expected


def test_first_world_after_a_loss_records_the_recovery_once() -> None:
    running = {"phase": "Running", "restarts": 0}
    survivors = [pod(i) for i in (0, 1, 3)]
    lost = run(job(status=running), pods=survivors, world=world_of([0, 1, 2, 3]))
    assert lost.world is None and "lastRecovery" not in lost.status  # settling
    shrunk = run(job(status=lost.status), pods=survivors,
                 world=world_of([0, 1, 2, 3]), now=NOW + 2.5)
    assert shrunk.world is not None and shrunk.world.size == 3
    assert shrunk.status["lastRecovery"] == {"failureTime": lost.status["lastFailureTime"],
                                             "seconds": 2.5}
    back = joining(2, shrunk.world.generation)
    grown = run(job(status=shrunk.status), pods=[pod(i) for i in range(4)],
                world=shrunk.world, reports=back, now=NOW + 9)
    assert grown.world is not None and grown.world.size == 4
    assert grown.status["lastRecovery"]["seconds"] == 2.5


def joining(index: int, generation: int) -> dict[str, Report]:
    """Worker ``index`` started, read world ``generation`` without it, and asks in."""
    return {f"tj-worker-{index}": Report(kind=ReportKind.JOINING, generation=generation,
                                         at=NOW - 1)}


def test_a_ready_newcomer_enters_the_ring_only_once_it_asks_to_join() -> None:
    # Ready (its container is up) but still starting: the ring trains on without it,
    # rather than stopping at its next commit to wait for torch's import.
    running = job(status={"phase": "Running"})
    pods = [pod(i) for i in range(4)]
    starting = run(running, pods=pods, world=world_of([0, 1, 2], generation=5))
    assert starting.world is None
    asks = run(running, pods=pods, world=world_of([0, 1, 2], generation=5),
               reports=joining(3, 5))
    assert asks.world is not None and asks.world.pods == tuple(f"tj-worker-{i}" for i in range(4))


def test_a_pod_replaced_under_its_name_enters_the_ring_only_once_it_asks_to_join() -> None:
    # Worker 2 was deleted and created again (same name, new uid): the ring goes on at
    # three while its process starts, instead of waiting for it inside a world of four.
    pods = [pod(0), pod(1), pod(2, uid="u2-again"), pod(3)]
    current = world_of([0, 1, 2, 3], generation=5)
    lost = run(job(status={"phase": "Running", "restarts": 0}), pods=pods, world=current)
    assert lost.world is None  # settling
    without = run(job(status=lost.status), pods=pods, world=current, now=NOW + 2.5)
    assert without.world is not None
    assert without.world.pods == ("tj-worker-0", "tj-worker-1", "tj-worker-3")
    asks = run(job(status=without.status), pods=pods, world=without.world,
               reports=joining(2, without.world.generation), now=NOW + 9)
    assert asks.world is not None and asks.world.size == 4
    assert ("tj-worker-2", "u2-again") in {(m.pod, m.pod_uid) for m in asks.world.members}


def test_a_joining_report_for_an_older_world_does_not_count() -> None:
    # Written before world 5 went out: the process may have joined and died since.
    stale = run(job(status={"phase": "Running"}), pods=[pod(i) for i in range(4)],
                world=world_of([0, 1, 2], generation=5), reports=joining(3, 4))
    assert stale.world is None


def test_the_first_world_waits_for_no_announcement() -> None:
    # Nobody trains yet, so nobody waits for a starting process.
    first = run(job(), pods=[pod(i) for i in range(4)])
    assert first.world is not None and first.world.size == 4


def _unbound(index: int, created: str) -> Obj:
    body = pod(index, phase="Pending", ready=False, node="")
    body["metadata"]["creationTimestamp"] = created
    return body


def test_a_gang_unbound_past_the_policys_timeout_is_withdrawn_and_placed_again() -> None:
    policy = SchedulingPolicySpec(gang_timeout_seconds=60)
    stale = "1970-01-12T13:45:40Z"  # NOW - 60 s
    pods = [pod(0), _unbound(1, stale), _unbound(2, stale)]
    placer = FakePlacer()
    decided = plan(Observed(job=job(replicas=3), pods=pods, world=None, reports={},
                            policy=policy, inventory=NODES), SETTINGS, NOW, placer)
    assert sorted(decided.delete) == ["tj-worker-1", "tj-worker-2"]
    assert decided.create == [] and placer.calls == 0  # placed again next round, not now
    assert [e.reason for e in decided.events] == ["GangTimeout"]


def test_a_gang_still_within_its_timeout_waits_for_the_scheduler() -> None:
    policy = SchedulingPolicySpec(gang_timeout_seconds=60)
    pods = [pod(0), _unbound(1, "1970-01-12T13:46:30Z")]  # NOW - 10 s
    decided = plan(Observed(job=job(replicas=2), pods=pods, world=None, reports={},
                            policy=policy, inventory=NODES), SETTINGS, NOW, FakePlacer())
    assert decided.delete == [] and decided.create == []
    assert decided.requeue_after is not None and decided.requeue_after <= 50


def _given_up(index: int, planned: str, nominated: str = "") -> Obj:
    """An unbound pod, 10 s old, that the scheduler marked Unschedulable."""
    body = _unbound(index, "1970-01-12T13:46:30Z")
    body["metadata"]["annotations"][PLANNED_NODE_ANNOTATION] = planned
    body["status"]["conditions"].append(
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"})
    if nominated:
        body["status"]["nominatedNodeName"] = nominated
    return body


ROOMY = Inventory(tuple(
    NodeInfo(name=n.name, rack=n.rack, nvlink_domain=n.nvlink_domain, gpu_model=n.gpu_model,
             free=Resources(cpu_milli=8000, memory=1 << 34, gpus=8, pods=8))
    for n in NODES.nodes))


def _withdrawn(pods: list[Obj], inventory: Inventory) -> tuple[list[str], list[str], float]:
    policy = SchedulingPolicySpec(gang_timeout_seconds=60)
    decided = plan(Observed(job=job(replicas=len(pods)), pods=pods, world=None, reports={},
                            policy=policy, inventory=inventory), SETTINGS, NOW, FakePlacer())
    assert decided.create == []
    return (sorted(decided.delete), [e.reason for e in decided.events],
            decided.requeue_after or 0.0)


def test_a_gang_whose_planned_node_was_taken_is_withdrawn_before_its_timeout() -> None:
    # Another pod was bound on rack-0-node-1 (no room left): the plan is overtaken, and
    # the scheduler would only retry it after minutes.
    full = Inventory(tuple(n if n.name == "rack-0-node-1" else ROOMY.by_name[n.name]
                           for n in NODES.nodes))
    pods = [pod(0), _given_up(1, "rack-0-node-1"), _unbound(2, "1970-01-12T13:46:30Z")]
    deleted, reasons, _ = _withdrawn(pods, full)
    assert deleted == ["tj-worker-1", "tj-worker-2"] and reasons == ["PlanOvertaken"]
    # So is one whose planned node left the inventory (deleted, cordoned, NotReady).
    gone = [pod(0), _given_up(1, "rack-9-node-0")]
    assert _withdrawn(gone, ROOMY)[:2] == (["tj-worker-1"], ["PlanOvertaken"])


def test_an_unschedulable_pod_whose_planned_node_has_room_waits_and_is_looked_at_again(
        ) -> None:
    # The binding that took its room may not be observed yet: looked at again soon.
    deleted, reasons, requeue = _withdrawn([pod(0), _given_up(1, "rack-0-node-1")], ROOMY)
    assert deleted == [] and reasons == [] and 0 < requeue <= 5
    # A pod waiting for the preemption it started is not overtaken, however full the node.
    full = Inventory(NODES.nodes)
    nominated = [pod(0), _given_up(1, "rack-0-node-1", nominated="rack-0-node-1")]
    assert _withdrawn(nominated, full)[:2] == ([], [])


def test_a_running_job_with_every_pod_in_place_is_not_placed_again() -> None:
    placer = FakePlacer()
    status = {"phase": "Running", "world": {"generation": 1, "size": 4}}
    result = run(job(status=status), pods=[pod(i) for i in range(4)], world=world_of(range(4)),
                 placer=placer)
    assert placer.calls == 0
    assert not result.create and result.world is None
