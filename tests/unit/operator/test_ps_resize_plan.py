"""spec.ps.replicas changing on a running job, as the planner decides it: which servers
the world counts and lists, which PS pods drain, when they go, and what is created."""

from __future__ import annotations

from typing import Any

from ringwright.objects import Obj
from ringwright.operator.api.conditions import rfc3339
from ringwright.operator.api.schedulingpolicy import SchedulingPolicySpec
from ringwright.operator.plan.manifests import (
    INDEX_LABEL,
    JOB_LABEL,
    LEAVING_ANNOTATION,
    PS,
    ROLE_LABEL,
    WORKER,
)
from ringwright.operator.plan.placement.placer import place
from ringwright.operator.plan.pods import PodState, PodView
from ringwright.operator.plan.reconcile import Observed, Plan, plan
from ringwright.operator.plan.servers import (
    PS_DRAIN_SECONDS,
    leaving_servers,
    listed_servers,
    server_count,
)
from ringwright.world import Env, Member, World
from tests.unit.operator.test_placement import inventory, rack
from tests.unit.operator.test_ps_pods import ps_job
from tests.unit.operator.test_reconcile import NOW, SETTINGS, world_of

NODE = "r-n0"


def view(index: int, state: PodState = PodState.READY, leaving: float | None = None,
         uid: str = "") -> PodView:
    return PodView(name=f"tj-ps-{index}", uid=uid or f"p{index}", role=PS, index=index,
                   state=state, ip=f"127.20.0.{index + 1}", node=NODE, leaving_since=leaving,
                   restarts=0)


def servers_world(count: int, listed: list[int]) -> World:
    ps = tuple(Member(rank=i, pod=f"tj-ps-{i}", pod_uid=f"p{i}", ip=f"127.20.0.{i + 1}")
               for i in listed)
    return world_of([0, 1]).model_copy(update={"ps": ps, "ps_replicas": count,
                                                "mode": "ParameterServer"})


# --- the pure rules ------------------------------------------------------------------------


def test_a_shrink_counts_the_new_number_at_once_and_a_first_world_the_spec() -> None:
    assert server_count(2, servers_world(3, [0, 1, 2]), [0, 1, 2]) == 2
    assert server_count(3, None, []) == 3


def test_a_grow_counts_each_new_server_once_it_is_ready_in_index_order() -> None:
    current = servers_world(2, [0, 1])
    assert server_count(4, current, [0, 1]) == 2
    assert server_count(4, current, [0, 1, 3]) == 2  # ps-2 first: shards move in order
    assert server_count(4, current, [0, 1, 2]) == 3
    assert server_count(4, current, [0, 1, 2, 3]) == 4
    # A server of the current count that is down keeps its place.
    assert server_count(3, current, [0, 2]) == 3


def test_the_world_lists_the_ready_servers_below_the_count_in_index_order() -> None:
    pods = [view(2), view(0), view(3), view(1)]
    assert [p.index for p in listed_servers(pods, 3)] == [0, 1, 2]


def test_a_serving_pod_past_the_count_drains_and_one_that_never_served_goes_at_once() -> None:
    world = servers_world(3, [0, 1, 2])
    fate = leaving_servers([view(0), view(1), view(2), view(3, uid="new")], 2, world, NOW)
    assert fate.drain == ("tj-ps-2",)
    assert fate.unserved == ("tj-ps-3",)  # not in the world: holds no shard
    assert fate.drained == fate.timed_out == ()
    assert fate.wait == PS_DRAIN_SECONDS


def test_a_draining_pod_goes_when_it_ended_or_when_the_drain_times_out() -> None:
    world = servers_world(2, [0, 1])
    ended = leaving_servers([view(2, PodState.SUCCEEDED, leaving=NOW - 5)], 2, world, NOW)
    assert ended.drained == ("tj-ps-2",) and ended.wait is None
    running = leaving_servers([view(2, leaving=NOW - 5)], 2, world, NOW)
    assert running.drained == running.timed_out == () and running.drain == ()
    assert running.wait == PS_DRAIN_SECONDS - 5
    late = leaving_servers([view(2, leaving=NOW - PS_DRAIN_SECONDS)], 2, world, NOW)
    assert late.timed_out == ("tj-ps-2",)


def test_a_drained_pod_whose_index_is_wanted_again_makes_room() -> None:
    world = servers_world(2, [0, 1])
    fate = leaving_servers([view(2, PodState.SUCCEEDED, leaving=NOW - 5)], 3, world, NOW)
    assert fate.drained == ("tj-ps-2",)
    serving = leaving_servers([view(2, leaving=NOW - 5)], 3, world, NOW)
    assert serving == type(serving)()  # still serving: it is a server again


# --- through the planner -------------------------------------------------------------------


def pod_body(role: str, index: int, uid: str, phase: str = "Running", ready: bool = True,
             leaving: float | None = None) -> Obj:
    body: Obj = {
        "metadata": {"name": f"tj-{role}-{index}", "uid": uid,
                     "labels": {JOB_LABEL: "tj", ROLE_LABEL: role, INDEX_LABEL: str(index)},
                     "annotations": {}},
        "spec": {"nodeName": NODE},
        "status": {"phase": phase, "conditions": [
            {"type": "Ready", "status": "True" if ready and phase == "Running" else "False",
             "lastTransitionTime": rfc3339(NOW - 100)}]},
    }
    body["status"]["podIP"] = (f"127.10.0.{index + 1}" if role == WORKER
                               else f"127.20.0.{index + 1}")
    if leaving is not None:
        body["metadata"]["annotations"][LEAVING_ANNOTATION] = f"{leaving}"
    return body


def run_round(replicas: int, ps: list[Obj], world: World, shards: int = 4) -> Plan:
    job = ps_job(status={"phase": "Running", "world": {"generation": world.generation}})
    job["spec"]["ps"].update(replicas=replicas, shards=shards)
    workers = [pod_body(WORKER, i, f"u{i}") for i in range(2)]
    observed = Observed(job=job, pods=workers + ps, world=world, reports={},
                        policy=SchedulingPolicySpec(), inventory=inventory(rack("r", 4)))
    decided: Plan = plan(observed, SETTINGS, NOW, place)
    return decided


def created(decided: Plan) -> list[str]:
    return [o["metadata"]["name"] for o in decided.create]


def reasons(decided: Plan) -> dict[str, str]:
    return {e.reason: e.message for e in decided.events}


def test_shrinking_drops_the_leaving_server_from_the_world_and_marks_it_leaving() -> None:
    decided = run_round(2, [pod_body(PS, i, f"p{i}") for i in range(3)],
                        servers_world(3, [0, 1, 2]))
    assert decided.world is not None
    assert decided.world.ps_replicas == 2
    assert [m.pod for m in decided.world.ps] == ["tj-ps-0", "tj-ps-1"]
    assert decided.mark_leaving == ["tj-ps-2"]
    assert "tj-ps-2" not in decided.delete and created(decided) == []
    told = reasons(decided)
    assert "3 -> 2" in told["ServersResized"] and "tj-ps-2" in told["ServerLeaving"]
    assert decided.status["world"]["psServers"] == 2
    assert decided.status["ps"]["desired"] == 2 and decided.status["ps"]["ready"] == 2


def test_a_drained_server_that_exited_0_is_deleted_not_counted_nor_replaced() -> None:
    leaving = pod_body(PS, 2, "p2", phase="Succeeded", leaving=NOW - 10)
    decided = run_round(2, [pod_body(PS, 0, "p0"), pod_body(PS, 1, "p1"), leaving],
                        servers_world(2, [0, 1]))
    assert decided.delete == ["tj-ps-2"]
    assert created(decided) == []
    assert decided.status.get("restarts", 0) == 0 and decided.status["phase"] == "Running"
    assert "ServerDrained" in reasons(decided)


def test_a_server_that_does_not_drain_in_time_is_deleted_with_a_warning() -> None:
    leaving = pod_body(PS, 2, "p2", leaving=NOW - PS_DRAIN_SECONDS - 1)
    decided = run_round(2, [pod_body(PS, 0, "p0"), pod_body(PS, 1, "p1"), leaving],
                        servers_world(2, [0, 1]))
    assert decided.delete == ["tj-ps-2"]
    warned = [e for e in decided.events if e.reason == "ServerDrainTimeout"]
    assert warned and warned[0].type == "Warning"


def test_a_failed_server_is_replaced_at_its_own_index_while_another_drains() -> None:
    ps = [pod_body(PS, 0, "p0"), pod_body(PS, 1, "p1", phase="Failed"),
          pod_body(PS, 2, "p2", leaving=NOW - 5)]
    decided = run_round(2, ps, servers_world(2, [0, 1]))
    assert created(decided) == []  # the index frees once the failed pod is gone
    assert "tj-ps-1" in decided.delete and "tj-ps-2" not in decided.delete
    ps[1]["metadata"]["deletionTimestamp"] = rfc3339(NOW)
    decided = run_round(2, ps, servers_world(2, [0]))
    assert created(decided) == ["tj-ps-1"]


def test_growing_creates_the_new_server_and_counts_it_once_it_is_ready() -> None:
    two = [pod_body(PS, i, f"p{i}") for i in range(2)]
    decided = run_round(3, two, servers_world(2, [0, 1]))
    assert created(decided) == ["tj-ps-2"]
    assert decided.world is None  # ps-2 is not up: the shards stay where they are
    env = {e["name"]: e.get("value") for e in decided.create[0]["spec"]["containers"][0]["env"]}
    assert env[Env.PS_SHARDS] == "4"
    starting = run_round(3, [*two, pod_body(PS, 2, "p2", ready=False)], servers_world(2, [0, 1]))
    assert starting.world is None and created(starting) == []
    decided = run_round(3, [*two, pod_body(PS, 2, "p2")], servers_world(2, [0, 1]))
    assert decided.world is not None and decided.world.ps_replicas == 3
    assert [m.pod for m in decided.world.ps] == ["tj-ps-0", "tj-ps-1", "tj-ps-2"]
    assert "2 -> 3" in reasons(decided)["ServersResized"]


def test_a_pod_past_the_count_that_never_served_is_deleted_at_once() -> None:
    ps = [pod_body(PS, i, f"p{i}") for i in range(3)]
    decided = run_round(2, ps, servers_world(2, [0, 1]))
    assert decided.delete == ["tj-ps-2"] and decided.mark_leaving == []
    assert "ServerRemoved" in reasons(decided)


def test_a_shrink_with_the_leaving_server_down_still_publishes_the_new_count() -> None:
    ps: list[Any] = [pod_body(PS, 0, "p0"), pod_body(PS, 1, "p1")]
    decided = run_round(2, ps, servers_world(3, [0, 1]))
    assert decided.world is not None and decided.world.ps_replicas == 2


def test_growing_back_waits_for_the_drained_server_to_go_rather_than_take_a_new_index() -> None:
    drained = pod_body(PS, 2, "p2", phase="Succeeded", leaving=NOW - 5)
    decided = run_round(3, [pod_body(PS, 0, "p0"), pod_body(PS, 1, "p1"), drained],
                        servers_world(2, [0, 1]))
    assert decided.delete == ["tj-ps-2"]
    assert created(decided) == []  # never tj-ps-3: past the count it would serve nothing
    drained["metadata"]["deletionTimestamp"] = rfc3339(NOW)
    decided = run_round(3, [pod_body(PS, 0, "p0"), pod_body(PS, 1, "p1"), drained],
                        servers_world(2, [0, 1]))
    assert created(decided) == ["tj-ps-2"]
