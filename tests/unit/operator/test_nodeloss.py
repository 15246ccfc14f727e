"""Node loss and container restarts: the pure rules, then the planner using them."""

from __future__ import annotations

from typing import Any

import pytest

from ringwright.objects import Obj
from ringwright.operator.api.conditions import rfc3339
from ringwright.operator.api.schedulingpolicy import NodeLoss, SchedulingPolicySpec
from ringwright.operator.plan.health.nodeloss import (
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


GRACE = 300.0


def pv(name: str, state: PodState = PodState.READY, node: str = "n1",
       unready_since: float | None = None, restarts: int = 0, uid: str = "",
       waiting: str = "", started: float | None = None, starting: bool = False,
       role: str = "worker") -> PodView:
    return PodView(name=name, uid=uid or f"u-{name}", role=role, index=0, state=state,
                   ip="127.0.0.2", node=node, leaving_since=None, restarts=restarts,
                   unready_since=unready_since, waiting=waiting, started=started,
                   starting=starting)


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


U = PodState.UNREADY
SLOW_LIMIT = 60.0
"""The unready limit of the slow-start cases: shorter than their containers' age."""


@pytest.mark.parametrize(("pod_", "lost", "due_at"), [
    # Never Ready since its container started 120 s ago (its Ready condition last changed
    # at the pod's start): within the grace, even past the limit; due at start+grace+limit.
    (pv("a", U, unready_since=NOW - 400, started=NOW - 120), "",
     NOW - 120 + GRACE + SLOW_LIMIT),
    # ... nor at the end of the grace; past the grace plus the limit: lost.
    (pv("a", U, unready_since=NOW - 400, started=NOW - GRACE), "", NOW + SLOW_LIMIT),
    (pv("a", U, unready_since=NOW - 400, started=NOW - GRACE - SLOW_LIMIT), "MemberNeverReady",
     None),
    # The Ready condition turned False in the same second the container started: it was
    # not Ready in this container.
    (pv("a", U, unready_since=NOW - 120, started=NOW - 120), "",
     NOW - 120 + GRACE + SLOW_LIMIT),
    # No Ready condition at all, but a running container: the grace counts from its start.
    (pv("a", U, started=NOW - GRACE - SLOW_LIMIT), "MemberNeverReady", None),
    # Ready in this container, then Unready past the limit: hung, lost as ever; not yet.
    (pv("a", U, unready_since=NOW - 65, started=NOW - 120), "MemberUnready", None),
    (pv("a", U, unready_since=NOW - 5, started=NOW - 120), "", NOW + 55),
    # Restarted by the kubelet (new startedAt, after its Ready condition turned False):
    # the new container gets the grace again.
    (pv("a", U, unready_since=NOW - 500, started=NOW - 10, restarts=3), "",
     NOW - 10 + GRACE + SLOW_LIMIT),
    # Waiting between restarts (CrashLoopBackOff: not running): as ever, from the turn.
    (pv("a", U, unready_since=NOW - 65, restarts=3, waiting="CrashLoopBackOff"),
     "MemberUnready", None),
    # The container has not run yet (image still pulling): not judged by readiness.
    (pv("a", U, unready_since=NOW - 400, starting=True), "", None),
    # A role without a grace: the limit counts from the container's start.
    (pv("a", U, unready_since=NOW - 400, started=NOW - SLOW_LIMIT, role="ps"),
     "MemberNeverReady", None),
])
def test_slow_starts_count_from_the_container_start_plus_the_grace(
        pod_: PodView, lost: str, due_at: float | None) -> None:
    losses, next_at = lost_members([pod_], {}, SLOW_LIMIT, NOW, {"worker": GRACE})
    assert [loss.reason for loss in losses] == ([lost] if lost else [])
    assert next_at == due_at


def test_a_slow_start_on_a_lost_node_is_still_lost_with_its_node() -> None:
    slow = pv("a", U, unready_since=NOW - 400, started=NOW - 10)
    losses, _ = lost_members([slow, pv("b", U, starting=True)], {"n1": NOW - LIMIT}, LIMIT,
                             NOW, {"worker": GRACE})
    assert [loss.reason for loss in losses] == ["NodeNotReady", "NodeNotReady"]


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
    assert seen.started is None and not seen.starting


@pytest.mark.parametrize(("statuses", "started", "starting"), [
    # The training container (the first in the spec) runs: its start is read.
    ([{"name": "train", "restartCount": 1, "state": {"running": {"startedAt": rfc3339(NOW - 9)}}}],
     NOW - 9, False),
    # Another container's start is not the training container's.
    ([{"name": "sidecar", "state": {"running": {"startedAt": rfc3339(NOW - 9)}}},
      {"name": "train", "restartCount": 0, "state": {"waiting": {"reason": "ContainerCreating"}}}],
     None, True),
    # Waiting after it ran: restarting, not starting.
    ([{"name": "train", "restartCount": 1, "state": {"waiting": {"reason": "CrashLoopBackOff"}}}],
     None, False),
    ([{"name": "train", "restartCount": 0, "state": {"waiting": {}},
       "lastState": {"terminated": {"exitCode": 1}}}], None, False),
    ([], None, False),
])
def test_the_pod_view_reads_the_training_containers_start(
        statuses: list[Obj], started: float | None, starting: bool) -> None:
    body = pod(0, ready=False)
    body["spec"]["containers"] = [{"name": "train"}, {"name": "sidecar"}]
    body["status"]["containerStatuses"] = statuses
    seen = view(body)
    assert seen is not None and (seen.started, seen.starting) == (started, starting)


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


def slow(body: Obj, started: float, ready_changed: float, restarts: int = 0) -> Obj:
    """``body`` Running and not Ready: its Ready condition last changed at
    ``ready_changed``, its training container started at ``started``."""
    body["status"]["conditions"][0].update(status="False",
                                           lastTransitionTime=rfc3339(ready_changed))
    body["spec"]["containers"] = [{"name": "train"}]
    body["status"]["containerStatuses"] = [
        {"name": "train", "restartCount": restarts, "ready": False,
         "state": {"running": {"startedAt": rfc3339(started)}}}]
    return body


def test_a_slow_start_within_its_grace_is_kept_and_not_counted() -> None:
    # Unready for 400 s (the policy's limit is 20), its container started 120 s ago.
    pods = [pod(i) for i in range(4)]
    slow(pods[1], started=NOW - 120, ready_changed=NOW - 400)
    decided = run(pods, workers={"min": 2, "replicas": 4, "startupGraceSeconds": 300,
                                 "template": {"spec": {"containers": [{"name": "train"}]}}})
    assert decided.delete == [] and decided.status.get("restarts", 0) == 0
    assert "MemberNeverReady" not in [e.reason for e in decided.events]
    # The default grace (600 s) holds it too; past the grace and the limit it is lost.
    assert run(pods).delete == []
    late = [pod(i) for i in range(4)]
    slow(late[1], started=NOW - 621, ready_changed=NOW - 900)
    decided = run(late)
    assert decided.delete == ["tj-worker-1"] and decided.status["restarts"] == 1
    assert "MemberNeverReady" in [e.reason for e in decided.events]


def test_a_restarted_container_gets_the_grace_again_and_its_restarts_count() -> None:
    pods = [pod(i) for i in range(4)]
    slow(pods[2], started=NOW - 5, ready_changed=NOW - 300, restarts=2)
    decided = run(pods, runPolicy={"backoffLimit": 3})
    assert decided.delete == []
    assert decided.status["restarts"] == 2
    assert decided.status["containerRestarts"] == {"tj-worker-2/u2": 2}


def test_a_member_ready_in_its_container_then_unready_is_lost_after_the_limit() -> None:
    pods = [pod(i) for i in range(4)]
    slow(pods[3], started=NOW - 120, ready_changed=NOW - 21)
    decided = run(pods)
    assert decided.delete == ["tj-worker-3"]
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
