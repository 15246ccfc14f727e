"""Refused writes: the round goes on, the user is told once, creates back off per job."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from ringwright.kube import ApiError
from ringwright.objects import Obj
from ringwright.operator.apply.events import EventRecorder
from ringwright.operator.apply.executor import Applier
from ringwright.operator.apply.refusals import (
    CONDITION,
    RefusalBackoff,
    Refused,
    is_refusal,
    refusal_conditions,
)
from ringwright.operator.observe.cache import Written
from ringwright.operator.observe.ledger import CapacityLedger
from ringwright.operator.plan.reconcile import Plan
from ringwright.world import JobRef, Member, StoreAddress, World
from tests.unit.operator.test_reconcile import NOW, FakePlacer, job, pod, run, world_of

QUOTA = ApiError(403, "Forbidden", 'pods "tj-worker-3" is forbidden: exceeded quota: q',
                 "POST /api/v1/namespaces/ns/pods")


class RefusingKube:
    """Accepts every write except pod creates, which a quota refuses."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def create(self, path: str, body: Obj) -> Obj:
        self.calls.append(("POST", path))
        if path.endswith("/pods"):
            raise QUOTA
        return {"metadata": {"name": f"ev-{len(self.calls)}", **body.get("metadata", {})}}

    def apply(self, path: str, body: Obj) -> Obj:
        self.calls.append(("APPLY", path))
        return {**body, "metadata": {**body["metadata"], "resourceVersion": "7"}}

    def merge_patch(self, path: str, body: Obj) -> Obj:
        self.calls.append(("PATCH", path))
        return {}

    def delete(self, path: str, grace: int | None = None) -> bool:
        self.calls.append(("DELETE", path))
        return True


def _applier(kube: RefusingKube) -> Applier:
    clock = lambda: NOW  # noqa: E731
    return Applier(kube, clock, pool=ThreadPoolExecutor(4),  # type: ignore[arg-type]
                   events=EventRecorder(kube, clock), ledger=CapacityLedger(),
                   written=Written())


def test_only_repeatable_client_errors_are_refusals() -> None:
    assert is_refusal(QUOTA)
    assert is_refusal(ApiError(422, "Invalid", "denied by policy", "POST pods"))
    assert not is_refusal(ApiError(409, "Conflict", "", "PATCH x"))
    assert not is_refusal(ApiError(429, "TooManyRequests", "", "POST x"))
    assert not is_refusal(ApiError(500, "InternalError", "", "POST x"))


def test_a_refused_create_leaves_world_deletes_and_status_to_happen() -> None:
    kube = RefusingKube()
    body = job(status={"phase": "Running", "world": {"generation": 1}})
    world = World(job=JobRef(namespace="ns", name="tj"), generation=2,
                  store=StoreAddress(address="127.0.0.1"),
                  members=(Member(rank=0, pod="tj-worker-0", pod_uid="u0", ip="127.0.0.1"),))
    plan = Plan(create=[pod(3)], delete=["tj-worker-1"], world=world, world_version="5",
                status={"phase": "Running", "world": {"generation": 2}})
    plan.create[0]["metadata"]["namespace"] = "ns"
    plan.create[0]["spec"] = {"containers": [{"name": "train"}]}  # the report key goes here
    refusals = _applier(kube).perform(body, plan)

    assert [r.reason for r in refusals] == ["FailedCreate"]
    assert "exceeded quota" in refusals[0].message
    verbs = [(verb, path.rsplit("/", 2)[-2:]) for verb, path in kube.calls]
    assert ("PATCH", ["configmaps", "tj-world"]) in verbs  # the world still went out
    assert ("DELETE", ["pods", "tj-worker-1"]) in verbs  # the dead member still went
    status_writes = [p for v, p in kube.calls if v == "APPLY" and p.endswith("/status")]
    assert len(status_writes) == 1
    events = [p for v, p in kube.calls if v == "POST" and p.endswith("/events")]
    assert len(events) == 1


def test_the_condition_names_the_refusal_and_clears_only_after_writes_go_through() -> None:
    refusal = Refused("create", "Pod", "tj-worker-3", "exceeded quota: q")
    conds = refusal_conditions([], [refusal, refusal], True, NOW, 1)
    assert conds[0]["type"] == CONDITION and conds[0]["status"] == "False"
    assert conds[0]["reason"] == "FailedCreate"
    assert conds[0]["message"].startswith("create Pod tj-worker-3: exceeded quota: q")
    assert "1 more" in conds[0]["message"]
    assert refusal_conditions(conds, [], False, NOW + 1, 1) == conds  # held back: unchanged
    cleared = refusal_conditions(conds, [], True, NOW + 2, 1)
    assert cleared[0]["status"] == "True" and cleared[0]["reason"] == "Accepted"
    assert refusal_conditions([], [], True, NOW, 1) == []  # nothing to say
    update = Refused("update", "ConfigMap", "tj-world", "denied")
    assert refusal_conditions([], [update], True, NOW, 1)[0]["reason"] == "FailedUpdate"


def test_backoff_doubles_per_refusal_up_to_the_cap_and_resets_on_success() -> None:
    backoff = RefusalBackoff(base=1.0, cap=4.0)
    key = ("ns", "tj")
    assert backoff.hold_until(key, NOW) is None
    assert [backoff.refused(key, NOW) - NOW for _ in range(4)] == [1.0, 2.0, 4.0, 4.0]
    assert backoff.hold_until(key, NOW + 3.9) == NOW + 4.0
    assert backoff.hold_until(key, NOW + 4.0) is None
    backoff.accepted(key)
    assert backoff.refused(key, NOW) - NOW == 1.0
    assert backoff.hold_until(("ns", "other"), NOW) is None  # per job


def test_a_write_refused_for_hours_keeps_the_capped_delay() -> None:
    backoff = RefusalBackoff(base=1.0, cap=4.0)
    key = ("ns", "terminating")  # say its namespace is being deleted: every write refused
    delays = [backoff.refused(key, NOW) - NOW for _ in range(5000)]
    assert delays[-1] == 4.0


def test_held_creates_are_not_planned_but_the_rest_of_the_round_is() -> None:
    placer = FakePlacer()
    pods = [pod(0), pod(1), pod(2)]
    held = run(job(), pods=pods, world=world_of([0, 1, 2, 3]), placer=placer,
               hold=NOW + 5)
    assert held.create == [] and placer.calls == 0
    assert held.requeue_after is not None and held.requeue_after <= 5
    assert held.status["restarts"] == 1  # the lost member is still counted
    assert held.world is None or "tj-worker-3" not in {m.pod for m in held.world.members}
    after = run(job(), pods=pods, world=world_of([0, 1, 2]), placer=placer, hold=NOW - 1)
    assert placer.calls == 1 and after.create
