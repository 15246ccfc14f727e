"""Policy trouble never freezes a job; activeDeadlineSeconds counts from creation."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ringwright.objects import Obj
from ringwright.operator.api.conditions import rfc3339
from ringwright.operator.observe.job import observe
from ringwright.operator.plan.reconcile import plan
from tests.unit.operator.test_ownership import JOB, FakeCache
from tests.unit.operator.test_reconcile import (
    NODES,
    NOW,
    SETTINGS,
    FakePlacer,
    job,
    pod,
    run,
    world_of,
)


class BadPolicyCache(FakeCache):
    def policy(self, name: str) -> Obj | None:
        return {"limits": {"maxWorkersPerJob": 0}}


class NoPolicyCache(FakeCache):
    def policy(self, name: str) -> Obj | None:
        return None


def _cond(status: Obj, type_: str) -> Obj:
    return next(c for c in status["conditions"] if c["type"] == type_)


def test_missing_and_invalid_policies_are_distinct_conditions() -> None:
    missing = observe(NoPolicyCache([], {}), JOB)
    assert missing.policy is None and missing.policy_error == ""
    invalid = observe(BadPolicyCache([], {}), JOB)
    assert invalid.policy is None
    assert "spec.limits.maxWorkersPerJob" in invalid.policy_error

    not_found = _cond(run(job(), policy=False).status, "PolicyFound")
    assert (not_found["status"], not_found["reason"]) == ("False", "PolicyNotFound")
    decided = plan(replace(invalid, job=job(), inventory=NODES), SETTINGS, NOW, FakePlacer())
    bad = _cond(decided.status, "PolicyFound")
    assert (bad["status"], bad["reason"]) == ("False", "PolicyInvalid")
    assert "spec.limits.maxWorkersPerJob" in bad["message"] and decided.create == []


def test_without_a_policy_a_lost_member_is_still_counted_and_dropped() -> None:
    pods = [pod(i) for i in range(3)]
    running = {"phase": "Running", "world": {"generation": 1}}
    placer = FakePlacer()
    first = run(job(status=running), pods=pods, world=world_of([0, 1, 2, 3]), policy=False,
                placer=placer)
    assert first.status["restarts"] == 1 and "MemberLost" in {e.reason for e in first.events}
    assert first.create == [] and placer.calls == 0
    later = run(job(status=first.status), pods=pods, world=world_of([0, 1, 2, 3]),
                policy=False, now=NOW + 3, placer=placer)
    assert later.world is not None and later.world.size == 3
    assert later.create == [] and placer.calls == 0


def test_without_a_policy_suspend_completion_and_deadline_still_work() -> None:
    pods = [pod(i) for i in range(4)]
    running = {"phase": "Running", "world": {"generation": 1}}
    suspended = run(job(status=running, runPolicy={"suspend": True}), pods=pods,
                    world=world_of(range(4)), policy=False)
    assert suspended.status["phase"] == "Suspended" and len(suspended.delete_gracefully) == 4

    done = [pod(0, phase="Succeeded"), *pods[1:]]
    completed = run(job(status=running), pods=done, world=world_of(range(4)), policy=False)
    assert completed.status["phase"] == "Succeeded"

    body = job(status=running, runPolicy={"activeDeadlineSeconds": 60})
    body["metadata"]["creationTimestamp"] = rfc3339(NOW - 60)
    expired = run(body, pods=pods, world=world_of(range(4)), policy=False)
    assert expired.status["phase"] == "Failed"


@pytest.mark.parametrize(("phase", "started", "reason"), [
    ("Pending", False, "NeverSchedulable"),
    ("Running", True, "DeadlineExceeded"),
    ("Suspended", True, "DeadlineExceeded"),
])
def test_the_deadline_counts_from_creation(phase: str, started: bool, reason: str) -> None:
    status: Obj = {"phase": phase, "conditions": [{
        "type": "Schedulable", "status": "False", "reason": "InsufficientCapacity",
        "message": "needs 8 x H100 in 1 rack"}]}
    if started:
        status["startTime"] = rfc3339(NOW - 10)  # started late: creation still counts
    body = job(status=status, runPolicy={"activeDeadlineSeconds": 100,
                                         "suspend": phase == "Suspended"})
    body["metadata"]["creationTimestamp"] = rfc3339(NOW - 99)
    early = run(body, now=NOW)
    assert early.status["phase"] != "Failed"
    assert early.requeue_after is not None and early.requeue_after <= 1
    late = run(body, now=NOW + 1)
    assert late.status["phase"] == "Failed"
    failed = _cond(late.status, "Failed")
    assert failed["reason"] == reason
    if reason == "NeverSchedulable":
        assert "InsufficientCapacity: needs 8 x H100 in 1 rack" in failed["message"]
