"""A queued job that grows and shrinks after admission (``kueueElastic``): its Workload is
a chain of slices; a scale-up asks with a new slice that replaces the admitted one, a
scale-down shrinks the admitted slice in place; at most one slice waits at a time."""

from __future__ import annotations

from typing import Any

from ringwright.objects import Obj
from ringwright.operator.api.schedulingpolicy import SchedulingPolicySpec
from ringwright.operator.observe.kueue import slices_of, with_queue
from ringwright.operator.plan.kueue import (
    ELASTIC_ANNOTATION,
    REPLACES_ANNOTATION,
    SLICE_ANNOTATION,
    Admission,
    resize_queued,
    workload,
    workload_name,
)
from ringwright.operator.plan.placement.placer import place
from ringwright.operator.plan.reconcile import Observed, plan
from tests.unit.operator.test_kueue_plan import NODES, PENDING, QUEUEING, admitted, queued
from tests.unit.operator.test_reconcile import NOW, pod

ELASTIC = QUEUEING.model_copy(update={"kueue_elastic": True})
EVICTED = {"conditions": [
    {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": ""},
    {"type": "Evicted", "status": "True", "reason": "Preempted", "message": "preempted"}],
    "admission": {"clusterQueue": "cq", "podSetAssignments": []}}


def first_slice(body: Obj, status: Obj | None, count: int | None = None,
                min_count: int | None = None) -> Obj:
    wl = workload(body, "team-a", SchedulingPolicySpec(), elastic=True)
    assert not isinstance(wl, Admission)
    workers = wl["spec"]["podSets"][0]
    if count is not None:
        workers["count"] = count
    if min_count is not None:
        workers["minCount"] = min_count
    wl["metadata"]["resourceVersion"] = "7"
    return {**wl, "status": status or {}}


def slice_of(body: Obj, number: int, count: int, status: Obj) -> Obj:
    wl = first_slice(body, status, count)
    wl["metadata"]["name"] = workload_name(body, number)
    wl["metadata"]["annotations"][SLICE_ANNOTATION] = str(number)
    return wl


def run(body: Obj, base: Obj | None, waiting: Obj | None = None, pods: int = 0,
        next_slice: int = 1) -> Any:
    observed = Observed(job=body, pods=[pod(i) for i in range(pods)], world=None,
                        reports={}, policy=SchedulingPolicySpec(), inventory=NODES,
                        workload=base, waiting_slice=waiting, next_slice=next_slice)
    return plan(observed, ELASTIC, NOW, place)


def workers_of(wl: Obj) -> Obj:
    return next(ps for ps in wl["spec"]["podSets"] if ps["name"] == "workers")


def condition(result: Any, type_: str) -> Obj | None:
    return next((c for c in result.status["conditions"] if c["type"] == type_), None)


def test_the_first_slice_is_marked_elastic() -> None:
    created = run(queued(replicas=2, minimum=2), None).workload
    assert created["metadata"]["annotations"] == {ELASTIC_ANNOTATION: "true",
                                                  SLICE_ANNOTATION: "0"}


def test_more_workers_than_admitted_ask_with_a_slice_that_replaces_the_admitted_one() -> None:
    body = queued(replicas=4, minimum=2)
    base = first_slice(body, admitted(2), count=2)
    result = run(body, base, pods=2, next_slice=1)
    grow = result.workload
    assert grow["metadata"]["name"] == workload_name(body, 1)
    assert grow["metadata"]["annotations"] == {
        ELASTIC_ANNOTATION: "true", SLICE_ANNOTATION: "1",
        REPLACES_ANNOTATION: f"{base['metadata']['namespace']}/{base['metadata']['name']}"}
    # Admitted only with at least one worker more: never swapped for a slice of 2.
    assert (workers_of(grow)["count"], workers_of(grow)["minCount"]) == (4, 3)
    assert grow["spec"]["queueName"] == base["spec"]["queueName"]
    assert grow["metadata"]["ownerReferences"] == base["metadata"]["ownerReferences"]
    assert result.create == [], "no pod beyond the admitted two"
    waiting = condition(result, "WaitingForQuota")
    assert waiting is not None and waiting["status"] == "True"
    assert "4 workers (2 admitted)" in waiting["message"]


def test_a_waiting_slice_says_kueues_reason_and_is_not_asked_for_twice() -> None:
    body = queued(replicas=4, minimum=2)
    base = first_slice(body, admitted(2), count=2)
    result = run(body, base, slice_of(body, 1, 4, PENDING), pods=2, next_slice=2)
    assert result.workload is None and result.workload_delete == []
    waiting = condition(result, "WaitingForQuota")
    assert waiting is not None and "4 more needed" in waiting["message"]


def test_a_waiting_slice_asking_for_another_number_goes_first() -> None:
    body = queued(replicas=3, minimum=2)
    base = first_slice(body, admitted(2), count=2)
    stale = slice_of(body, 1, 4, PENDING)
    result = run(body, base, stale, pods=2, next_slice=2)
    assert result.workload_delete == [stale["metadata"]["name"]]
    assert result.workload is None
    back = run(queued(replicas=2, minimum=2), base, stale, pods=2, next_slice=2)
    assert back.workload_delete == [stale["metadata"]["name"]]


def test_fewer_workers_shrink_the_admitted_slice_in_place() -> None:
    body = queued(replicas=2, minimum=2)
    base = first_slice(body, admitted(4), count=4, min_count=2)
    result = run(body, base, pods=4)
    patch = result.workload_resize
    assert patch["metadata"] == {"name": base["metadata"]["name"], "resourceVersion": "7"}
    assert (workers_of(patch)["count"], workers_of(patch)["minCount"]) == (2, 2)
    assert result.workload is None


def test_below_the_slices_own_min_count_a_replacing_slice_is_asked_for() -> None:
    # Kueue keeps a slice's minCount fixed: a slice admitted with "at least 3" cannot
    # shrink to 2 in place.
    body = queued(replicas=2, minimum=1)
    base = slice_of(body, 1, 4, admitted(4))
    workers_of(base)["minCount"] = 3
    result = run(body, base, pods=4, next_slice=2)
    assert result.workload_resize is None
    assert result.workload["metadata"]["name"] == workload_name(body, 2)
    assert (workers_of(result.workload)["count"], workers_of(result.workload)["minCount"]) \
        == (2, 1)


def test_an_evicted_job_withdraws_its_waiting_slice() -> None:
    body = queued(replicas=4, minimum=2)
    base = first_slice(body, EVICTED, count=2)
    waiting = slice_of(body, 1, 4, PENDING)
    result = run(body, base, waiting, pods=2, next_slice=2)
    assert result.workload_delete == [waiting["metadata"]["name"]]
    assert result.status["phase"] == "Suspended"


def test_a_queued_workload_follows_the_replicas_until_quota_is_reserved() -> None:
    body = queued(replicas=6, minimum=2)
    base = first_slice(body, PENDING, count=4)
    patch = resize_queued(body, base)
    assert patch is not None and workers_of(patch)["count"] == 6
    assert run(body, base).workload_resize == patch
    assert resize_queued(body, first_slice(body, admitted(4), count=4)) is None
    assert resize_queued(body, first_slice(body, PENDING, count=6)) is None


def test_a_finished_job_finishes_every_slice_not_finished() -> None:
    body = queued(replicas=4, minimum=2, status={"phase": "Succeeded"})
    base = first_slice(body, admitted(2), count=2)
    waiting = slice_of(body, 1, 4, PENDING)
    result = run(body, base, waiting, next_slice=2)
    assert result.finish_workloads == [base["metadata"]["name"], waiting["metadata"]["name"]]


def test_without_elastic_slices_the_job_runs_what_was_admitted() -> None:
    body = queued(replicas=4, minimum=2)
    base = first_slice(body, admitted(2), count=2)
    observed = Observed(job=body, pods=[pod(0), pod(1)], world=None, reports={},
                        policy=SchedulingPolicySpec(), inventory=NODES, workload=base)
    result = plan(observed, QUEUEING, NOW, place)
    assert result.workload is None and condition(result, "WaitingForQuota") is None


class Workloads:
    """The cache's answers for one job's Workloads."""

    def __init__(self, workloads: list[Obj]) -> None:
        self.items = workloads

    def workloads(self, namespace: str, job: str) -> list[Obj]:
        return self.items

    def flavor_labels(self, name: str) -> dict[str, str]:
        return {"gpu": name}

    def workload_priority(self, name: str) -> int | None:
        return None


def test_the_chain_is_read_oldest_first_and_the_next_slice_numbered_after_the_last() -> None:
    body = queued(replicas=4, minimum=2)
    finished = slice_of(body, 0, 2, {"conditions": [
        {"type": "Finished", "status": "True", "reason": "WorkloadSliceReplaced"}]})
    active = slice_of(body, 1, 3, admitted(3))
    waiting = slice_of(body, 2, 4, PENDING)
    other = first_slice(queued(), admitted(2))
    other["metadata"]["name"] = "trainingjob-tj-older"  # an earlier job of the same name
    assert slices_of([waiting, other, active, finished], workload_name(body)) == [
        finished, active, waiting]
    observed = Observed(job=body, pods=[], world=None, reports={},
                        policy=SchedulingPolicySpec(), inventory=NODES)
    seen = with_queue(observed, Workloads([waiting, active, finished, other]))  # type: ignore[arg-type]
    assert seen.workload is active and seen.waiting_slice is waiting
    assert seen.next_slice == 3
    assert seen.flavor_labels == {"h100": {"gpu": "h100"}}
