"""Node loss and container restarts: the pure rules, then the planner using them."""

from __future__ import annotations

from typing import Any

import pytest

from ringwright.objects import Obj
from ringwright.operator.api.conditions import rfc3339
from ringwright.operator.api.schedulingpolicy import NodeLoss, SchedulingPolicySpec
from ringwright.operator.plan.nodeloss import (
    NOT_READY_TAINT,
    UNREACHABLE_TAINT,
    crash_looping,
    lost_members,
    new_container_restarts,
    node_loss_tolerations,
)
from ringwright.operator.plan.pods import PodState, PodView, view
from ringwright.operator.plan.reconcile import Observed, Plan, plan
from tests.unit.operator.test_reconcile import NODES, NOW, SETTINGS, FakePlacer, job, pod, world_of

LIMIT = 20.0


def pv(name: str, state: PodState = PodState.READY, node: str = "n1",
       unready_since: float | None = None, restarts: int = 0, uid: str = "",
       waiting: str = "") -> PodView:
    return PodView(name=name, uid=uid or f"u-{name}", role="worker", index=0, state=state,
                   ip="127.0.0.2", node=node, leaving_since=None, restarts=restarts,
                   unready_since=unready_since, waiting=waiting)


def test_tolerations_replace_the_templates_node_loss_ones_and_keep_the_rest() -> None:
    template: list[Obj] = [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},
                {"key": NOT_READY_TAINT, "operator": "Exists", "effect": "NoExecute",
                 "tolerationSeconds": 600}]
    out = node_loss_tolerations(template, 15)
    assert out[0] == template[0]
    assert {(t["key"], t["effect"], t["tolerationSeconds"]) for t in out[1:]} == {
        (NOT_READY_TAINT, "NoExecute", 15), (UNREACHABLE_TAINT, "NoExecute", 15)}
    assert len(out) == 3


@pytest.mark.parametrize(("pod_", "down", "lost", "due_at"), [
    # On a node NotReady long enough: lost, member or not.
    (pv("a"), {"n1": NOW - LIMIT}, "NodeNotReady", None),
    (pv("x", state=PodState.PENDING), {"n1": NOW - 30}, "NodeNotReady", None),
    # Not yet long enough: look again when it will be.
    (pv("a"), {"n1": NOW - 5}, "", NOW + 15),
    # Running Unready past the threshold (it left the world at once), or not yet.
    (pv("a", PodState.UNREADY, unready_since=NOW - 25), {}, "MemberUnready", None),
    (pv("a", PodState.UNREADY, unready_since=NOW - 1), {}, "", NOW + 19),
    # Unready with no transition time known: never declared lost on a guess.
    (pv("a", PodState.UNREADY), {}, "", None),
    # Already going, or finished: not lost again.
    (pv("a", PodState.DELETING), {"n1": NOW - 100}, "", None),
    (pv("a", PodState.SUCCEEDED), {"n1": NOW - 100}, "", None),
    # A Ready member on a Ready node.
    (pv("a"), {"n2": NOW - 100}, "", None),
])
def test_lost_members(pod_: PodView, down: dict[str, float], lost: str,
                      due_at: float | None) -> None:
    losses, next_at = lost_members([pod_], down, LIMIT, NOW, {})
    assert [loss.reason for loss in losses] == ([lost] if lost else [])
    assert next_at == due_at


def test_container_restarts_count_once_per_pod_incarnation() -> None:
    fresh, record = new_container_restarts([pv("a", restarts=2), pv("b")], {})
    assert fresh == {"a/u-a": 2} and record == {"a/u-a": 2}
    fresh, record = new_container_restarts([pv("a", restarts=3), pv("b")], record)
    assert fresh == {"a/u-a": 1} and record == {"a/u-a": 3}
    # The pod was replaced (new uid): its restarts start from zero; the old one is gone.
    fresh, record = new_container_restarts([pv("a", restarts=1, uid="u2")], record)
    assert fresh == {"a/u2": 1} and record == {"a/u2": 1}


def test_crash_looping_pods_are_named() -> None:
    assert crash_looping([pv("b", waiting="CrashLoopBackOff"), pv("a"),
                          pv("c", waiting="ContainerCreating")]) == ["b"]


def test_the_pod_view_reads_unready_since_and_the_waiting_reason() -> None:
    body = pod(0, ready=False)
    body["status"]["conditions"][0]["lastTransitionTime"] = rfc3339(NOW - 7)
    body["status"]["containerStatuses"] = [
        {"name": "train", "restartCount": 4,
         "state": {"waiting": {"reason": "CrashLoopBackOff"}}}]
    seen = view(body)
    assert seen is not None
    assert seen.state == PodState.UNREADY and seen.unready_since == NOW - 7
    assert seen.waiting == "CrashLoopBackOff" and seen.restarts == 4


def run(pods: list[Obj], status: Obj | None = None, down: dict[str, float] | None = None,
        members: tuple[int, ...] = (0, 1, 2, 3), **spec: Any) -> Plan:
    observed = Observed(
        job=job(status=status or {"phase": "Running", "world": {"generation": 1}}, **spec),
        pods=pods, world=world_of(members), reports={},
        policy=SchedulingPolicySpec(node_loss=NodeLoss(toleration_seconds=12,
                                                       unready_seconds=20)),
        inventory=NODES, node_down_since=down or {})
    return plan(observed, SETTINGS, NOW, FakePlacer())


def test_a_member_on_a_lost_node_is_replaced_and_counted() -> None:
    pods = [pod(i, node="rack-0-node-0" if i == 2 else "rack-1-node-0") for i in range(4)]
    decided = run(pods, down={"rack-0-node-0": NOW - 30})
    assert decided.delete == ["tj-worker-2"]
    assert decided.status["restarts"] == 1
    assert "NodeNotReady" in [e.reason for e in decided.events]
    assert decided.status["candidate"] is not None  # the smaller world, settling


def test_a_member_unready_too_long_is_replaced() -> None:
    pods = [pod(i) for i in range(4)]
    pods[1]["status"]["conditions"][0].update(status="False",
                                              lastTransitionTime=rfc3339(NOW - 21))
    decided = run(pods)
    assert decided.delete == ["tj-worker-1"]
    assert "MemberUnready" in [e.reason for e in decided.events]


def test_new_pods_carry_the_policys_node_loss_tolerations() -> None:
    decided = run([pod(i) for i in range(3)], members=(0, 1, 2))
    created = decided.create[0]["spec"]["tolerations"]
    assert {(t["key"], t["tolerationSeconds"]) for t in created} == {
        (NOT_READY_TAINT, 12), (UNREACHABLE_TAINT, 12)}


def test_container_restarts_count_toward_the_backoff_limit() -> None:
    pods = [pod(i) for i in range(4)]
    pods[0]["status"]["containerStatuses"] = [{"name": "train", "restartCount": 2}]
    decided = run(pods, runPolicy={"backoffLimit": 3})
    assert decided.status["restarts"] == 2
    assert decided.status["containerRestarts"] == {"tj-worker-0/u0": 2}
    assert decided.status["phase"] == "Running"
    # Seen again: not counted twice. Two more restarts: over the limit.
    again = run(pods, status={**decided.status}, runPolicy={"backoffLimit": 3})
    assert again.status["restarts"] == 2
    pods[0]["status"]["containerStatuses"][0]["restartCount"] = 4
    over = run(pods, status={**decided.status}, runPolicy={"backoffLimit": 3})
    assert over.status["restarts"] == 4 and over.status["phase"] == "Failed"


def test_crash_loop_back_off_shows_as_a_condition_and_clears() -> None:
    pods = [pod(i) for i in range(4)]
    pods[3]["status"]["containerStatuses"] = [
        {"name": "train", "restartCount": 1, "state": {"waiting": {"reason": "CrashLoopBackOff"}}}]
    looping = run(pods, runPolicy={"backoffLimit": 10})
    cond = next(c for c in looping.status["conditions"] if c["type"] == "CrashLoopBackOff")
    assert cond["status"] == "True" and "tj-worker-3" in cond["message"]
    assert "CrashLoopBackOff" in [e.reason for e in looping.events]
    pods[3]["status"]["containerStatuses"][0]["state"] = {"running": {}}
    cleared = run(pods, status={**looping.status}, runPolicy={"backoffLimit": 10})
    cond = next(c for c in cleared.status["conditions"] if c["type"] == "CrashLoopBackOff")
    assert cond["status"] == "False"
