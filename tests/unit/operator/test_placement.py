"""Placement planner: table-driven cases for each rule, and the fragments it turns into."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import pytest

from ringwright.operator.api.models import RackPacking, TrainingJobSpec
from ringwright.operator.api.schedulingpolicy import SchedulingPolicySpec
from ringwright.operator.plan.placement.fragments import node_affinity, pod_fragments
from ringwright.operator.plan.placement.inventory import Inventory, NodeInfo, Taint
from ringwright.operator.plan.placement.planner import (
    PlacementPlan,
    PlacementRequest,
    Role,
    Unschedulable,
    placement_request,
    plan_placement,
)
from ringwright.operator.plan.placement.resources import Resources

GI = 1024**3
H100, A100 = "H100", "A100"
POLICY = SchedulingPolicySpec()


def rack(name: str, nodes: int, *, gpus: int = 8, model: str = H100, per_domain: int = 2,
         spine: str = "", cpu: int = 64) -> list[NodeInfo]:
    """``nodes`` identical nodes in rack ``name``, ``per_domain`` to an NVLink domain."""
    return [
        NodeInfo(
            name=f"{name}-n{i}", rack=name, nvlink_domain=f"{name}-d{i // per_domain}",
            gpu_model=model, spine=spine,
            free=Resources(cpu * 1000, 512 * GI, gpus, 110),
        )
        for i in range(nodes)
    ]


def inventory(*racks: list[NodeInfo]) -> Inventory:
    return Inventory(tuple(n for r in racks for n in r))


def request(workers: int, gpus: int = 1, **kw: Any) -> PlacementRequest:
    kw.setdefault("min_new_workers", workers)
    return PlacementRequest(workers=workers, worker_pod=Resources(1000, GI, gpus, 1), **kw)


def planned(req: PlacementRequest, inv: Inventory, policy: SchedulingPolicySpec = POLICY
            ) -> PlacementPlan:
    plan = plan_placement(req, inv, policy)
    assert isinstance(plan, PlacementPlan), plan
    return plan


def per_rack(plan: PlacementPlan) -> dict[str, int]:
    return dict(Counter(w.rack for w in plan.workers))


# (what, request, inventory, workers per rack)
CASES = [
    ("one rack, the tightest that fits",
     request(16), inventory(rack("big", 4), rack("small", 2)), {"small": 16}),
    ("fewest racks before tightness",
     request(40), inventory(rack("a", 2), rack("b", 2), rack("c", 4)), {"a": 16, "c": 24}),
    ("fills one NVLink domain before the next",
     request(2, gpus=4), inventory(rack("r", 4)), {"r": 2}),
    ("a requested model wins over a better fit",
     request(8, gpu_model=A100), inventory(rack("h", 1), rack("a", 4, model=A100)), {"a": 8}),
    ("rack limit holds even when more racks would fit more",
     request(24, min_new_workers=8, max_racks=1), inventory(rack("a", 2), rack("b", 2)),
     {"a": 16}),
    ("partial when replicas exceed the room but min fits",
     request(20, min_new_workers=8), inventory(rack("a", 2)), {"a": 16}),
]


@pytest.mark.parametrize(("req", "inv", "expected"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_workers_per_rack(req: PlacementRequest, inv: Inventory, expected: dict[str, int]) -> None:
    plan = planned(req, inv)
    assert per_rack(plan) == expected
    assert plan.shortfall == req.workers - sum(expected.values())


def test_nvlink_domain_and_node_are_filled_first() -> None:
    plan = planned(request(2, gpus=4), inventory(rack("r", 4)))
    assert {w.node for w in plan.workers} == {"r-n0"}
    plan = planned(request(4, gpus=4), inventory(rack("r", 4)))
    assert {w.nvlink_domain for w in plan.workers} == {"r-d0"}


def test_partly_used_nodes_are_filled_before_empty_ones() -> None:
    nodes = rack("r", 3)
    nodes[2] = replace(nodes[2], free=Resources(64_000, 512 * GI, 3, 110))
    plan = planned(request(3), inventory(nodes))
    assert [w.node for w in plan.workers] == ["r-n2"] * 3


def test_workers_come_in_ring_order() -> None:
    plan = planned(request(40), inventory(rack("b", 4), rack("a", 4)))
    keys = [(w.rack, w.nvlink_domain, w.node) for w in plan.workers]
    assert keys == sorted(keys)


def test_one_gpu_model_for_the_whole_job() -> None:
    inv = inventory(rack("h", 2), rack("a", 2, model=A100))
    plan = planned(request(24, min_new_workers=1), inv)
    assert {w.rack for w in plan.workers} in ({"h"}, {"a"})
    assert plan.shortfall == 8


def test_allowed_models_are_tried_in_the_admins_order() -> None:
    inv = inventory(rack("h", 2), rack("a", 2, model=A100))
    policy = SchedulingPolicySpec(allowed_gpu_models=[H100, A100])
    assert planned(request(8), inv, policy).gpu_model == H100
    policy = SchedulingPolicySpec(allowed_gpu_models=[A100, H100])
    assert planned(request(8), inv, policy).gpu_model == A100


def test_a_model_that_fits_in_fewer_racks_wins() -> None:
    inv = inventory(rack("h1", 1), rack("h2", 1), rack("a", 4, model=A100))
    assert planned(request(16), inv).gpu_model == A100


def test_scale_up_stays_on_the_jobs_model_and_racks() -> None:
    inv = inventory(rack("big", 4), rack("mine", 2), rack("other", 2, model=A100))
    plan = planned(request(4, current_worker_nodes=("mine-n0",)), inv)
    assert per_rack(plan) == {"mine": 4}
    assert plan.racks == ("mine",)
    full = inventory(rack("big", 4), rack("mine", 2, gpus=0), rack("other", 2, model=A100))
    plan = planned(request(4, current_worker_nodes=("mine-n0",)), full)
    assert plan.gpu_model == H100
    assert plan.racks == ("big", "mine")  # the rack set keeps the current rack


def test_scale_up_respects_the_rack_limit_counting_current_racks() -> None:
    inv = inventory(rack("a", 1, gpus=0), rack("b", 1), rack("c", 1))
    req = request(16, min_new_workers=0, current_worker_nodes=("a-n0",), max_racks=2)
    plan = planned(req, inv)
    assert len(plan.workers) == 8 and plan.shortfall == 8
    assert len(plan.racks) == 2


def test_gang_refusal_says_what_is_missing_in_numbers() -> None:
    inv = inventory(rack("a", 1), rack("b", 1, gpus=4))
    result = plan_placement(request(16, gpus=1, gpu_model=H100, max_racks=1), inv, POLICY)
    assert result == Unschedulable(
        "InsufficientCapacity",
        "needs 16 x H100 workers (1 GPU, 1 CPU, 1Gi each) within 1 racks; "
        "best 1-rack set has room for 8",
    )


def test_gang_refusal_names_every_model_tried() -> None:
    inv = inventory(rack("a", 1), rack("b", 1, model=A100, gpus=4))
    result = plan_placement(request(16), inv, POLICY)
    assert isinstance(result, Unschedulable)
    assert result.message.endswith("room for 8; other models: A100 room for 4")


def test_a_model_the_policy_does_not_allow_is_refused() -> None:
    policy = SchedulingPolicySpec(allowed_gpu_models=[A100])
    result = plan_placement(request(1, gpu_model=H100), inventory(rack("a", 1)), policy)
    assert isinstance(result, Unschedulable) and result.reason == "GPUModelNotAllowed"
    assert "H100" in result.message and "A100" in result.message


def test_no_gpu_nodes_at_all() -> None:
    result = plan_placement(request(1), inventory(rack("a", 1, model="")), POLICY)
    assert isinstance(result, Unschedulable) and result.reason == "NoGPUNodes"


def test_cpu_jobs_ignore_gpu_models() -> None:
    inv = inventory(rack("a", 1, cpu=4, model=H100), rack("b", 1, cpu=4, model=""))
    req = PlacementRequest(workers=8, min_new_workers=8, worker_pod=Resources(1000, GI, 0, 1))
    plan = planned(req, inv)
    assert plan.gpu_model == "" and per_rack(plan) == {"a": 4, "b": 4}


def test_taints_keep_workers_off_unless_tolerated() -> None:
    tainted = [replace(n, taints=(Taint("dedicated", "infer"),)) for n in rack("t", 2)]
    inv = inventory(tainted, rack("ok", 1))
    assert per_rack(planned(request(8), inv)) == {"ok": 8}
    tol = ({"key": "dedicated", "operator": "Equal", "value": "infer"},)
    assert per_rack(planned(request(16, worker_tolerations=tol), inv)) == {"t": 16}


# --- ps pods -------------------------------------------------------------------------------


def ps_request(workers: int, ps: int, **kw: Any) -> PlacementRequest:
    return request(workers, ps=ps, ps_pod=Resources(4000, 8 * GI, 0, 1), **kw)


def test_ps_pods_go_to_the_workers_rack_one_per_node() -> None:
    plan = planned(ps_request(8, 2), inventory(rack("other", 4), rack("w", 1), rack("x", 4)))
    assert per_rack(plan) == {"w": 8}
    assert plan.ps_racks == ("w",)
    plan = planned(ps_request(16, 3), inventory(rack("w", 4)))
    assert len({p.node for p in plan.ps}) == 3


def test_ps_pods_go_next_door_when_the_workers_rack_is_full() -> None:
    inv = inventory(rack("w", 1, cpu=8, spine="s1"), rack("far", 1, gpus=16, spine="s2"),
                    rack("near", 1, gpus=0, spine="s1"))
    plan = planned(ps_request(8, 2), inv)
    assert plan.ps_racks == ("near",)


def test_ps_pods_preempt_lower_priority_pods_when_nothing_is_free() -> None:
    # The workers take all free CPU and memory; lower-priority pods hold 16 CPUs more.
    full = replace(rack("w", 1)[0], free=Resources(8000, 8 * GI, 8, 100),
                   preemptible=Resources(16_000, 64 * GI, 0, 4))
    plan = planned(ps_request(8, 2), inventory([full]))
    assert all(p.preempts for p in plan.ps)
    result = plan_placement(ps_request(8, 5), inventory([full]), POLICY)
    assert isinstance(result, Unschedulable) and "needs 5 ps pods" in result.message


# --- from a job spec -----------------------------------------------------------------------


def job(**spec: Any) -> TrainingJobSpec:
    template = {"spec": {"containers": [{"name": "t", "image": "x",
                                         "resources": {"requests": {"cpu": "2"}}}]}}
    base: dict[str, Any] = {"workers": {"replicas": 4, "min": 2, "template": template}}
    return TrainingJobSpec.model_validate({**base, **spec})


def test_placement_request_from_a_spec() -> None:
    ps_template = {"spec": {"containers": [{"name": "p", "resources": {"requests": {
        "cpu": "1500m", "memory": "4Gi"}}}]}}
    spec = job(gpusPerWorker=2, mode="ParameterServer", ps={"replicas": 2, "template": ps_template},
               topology={"maxRacks": 3})
    policy = SchedulingPolicySpec.model_validate({"limits": {"maxRacksPerJob": 2},
                                                  "rackPacking": "Preferred"})
    req = placement_request(spec, policy, current_workers=("n1", ""), current_ps=("n2",))
    assert req == PlacementRequest(
        workers=2, min_new_workers=0, worker_pod=Resources(2000, 0, 2, 1), gpu_model=None,
        ps=1, ps_pod=Resources(2000, 4 * GI, 0, 1), current_worker_nodes=("n1",),
        current_ps_nodes=("n2",), max_racks=2, rack_packing=RackPacking.PREFERRED,
    )


@pytest.mark.parametrize(
    ("policy_packing", "job_packing", "effective"),
    [("Required", None, "Required"), ("Preferred", None, "Preferred"),
     ("Preferred", "Required", "Required"), ("Required", "Preferred", "Required")],
)
def test_a_job_may_tighten_packing_never_loosen(
    policy_packing: str, job_packing: str | None, effective: str
) -> None:
    policy = SchedulingPolicySpec.model_validate({"rackPacking": policy_packing})
    topology = {"rackPacking": job_packing} if job_packing else {}
    req = placement_request(job(topology=topology), policy)
    assert isinstance(req, PlacementRequest) and req.rack_packing == effective


@pytest.mark.parametrize(
    ("limits", "spec", "text"),
    [({"maxWorkersPerJob": 3}, {}, "limits.maxWorkersPerJob"),
     ({"maxPsPerJob": 1}, {"mode": "ParameterServer", "ps": {"replicas": 2, "template": {
         "spec": {"containers": [{"name": "p"}]}}}}, "limits.maxPsPerJob")],
)
def test_policy_limits_refuse_the_job(limits: dict[str, int], spec: dict[str, Any], text: str
                                      ) -> None:
    policy = SchedulingPolicySpec.model_validate({"limits": limits})
    result = placement_request(job(**spec), policy)
    assert isinstance(result, Unschedulable) and result.reason == "ExceedsPolicyLimit"
    assert text in result.message


# --- fragments -----------------------------------------------------------------------------


def test_worker_fragment_requires_model_and_rack_set_and_prefers_the_planned_node() -> None:
    spec = job(gpusPerWorker=4)
    plan = planned(request(12, gpus=4), inventory(rack("a", 4), rack("b", 2)))
    frags = pod_fragments(plan, Role.WORKER, spec, POLICY)
    assert len(frags) == 12
    first = frags[0]
    assert first["priorityClassName"] == "ringwright-worker"
    assert first["resources"] == {"requests": {"cpu": "2", "nvidia.com/gpu": "4"},
                                  "limits": {"nvidia.com/gpu": "4"}}
    affinity = first["affinity"]["nodeAffinity"]
    assert affinity["requiredDuringSchedulingIgnoredDuringExecution"] == {"nodeSelectorTerms": [
        {"matchExpressions": [
            {"key": "nvidia.com/gpu.product", "operator": "In", "values": [H100]},
            {"key": "ringwright.dev/rack", "operator": "In", "values": list(plan.racks)},
        ]}]}
    preferred = affinity["preferredDuringSchedulingIgnoredDuringExecution"]
    w = plan.workers[0]
    assert preferred == [
        {"weight": 100, "preference": {"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [w.node]}]}},
        {"weight": 60, "preference": {"matchExpressions": [
            {"key": "nvidia.com/gpu.clique", "operator": "In", "values": [w.nvlink_domain]}]}},
        {"weight": 30, "preference": {"matchExpressions": [
            {"key": "ringwright.dev/rack", "operator": "In", "values": [w.rack]}]}},
    ]


def test_preferred_packing_moves_the_rack_set_to_preferences() -> None:
    plan = planned(request(8, rack_packing=RackPacking.PREFERRED), inventory(rack("a", 1)))
    affinity = node_affinity(plan, plan.workers[0])
    required = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert required == [{"matchExpressions": [
        {"key": "nvidia.com/gpu.product", "operator": "In", "values": [H100]}]}]
    assert {"weight": 80, "preference": {"matchExpressions": [
        {"key": "ringwright.dev/rack", "operator": "In", "values": ["a"]}]}} in affinity[
        "preferredDuringSchedulingIgnoredDuringExecution"]


def test_nodes_without_a_rack_label_are_selected_by_absence() -> None:
    req = PlacementRequest(workers=6, min_new_workers=6, worker_pod=Resources(1000, GI, 0, 1))
    plan = planned(req, inventory(rack("", 1, cpu=4), rack("a", 1, cpu=2)))
    terms = node_affinity(plan, plan.workers[0])[
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [
        {"matchExpressions": [{"key": "ringwright.dev/rack", "operator": "In", "values": ["a"]}]},
        {"matchExpressions": [{"key": "ringwright.dev/rack", "operator": "DoesNotExist"}]},
    ]


def test_ps_fragment_is_high_priority_guaranteed_without_gpu_terms() -> None:
    ps_template = {"spec": {"containers": [{"name": "p"}]}}
    spec = job(mode="ParameterServer", ps={"replicas": 1, "template": ps_template})
    plan = planned(ps_request(8, 1), inventory(rack("a", 1)))
    [frag] = pod_fragments(plan, Role.PS, spec, POLICY)
    assert frag["priorityClassName"] == "ringwright-ps"
    assert frag["resources"]["requests"] == frag["resources"]["limits"] == {
        "cpu": "4", "memory": "8Gi"}
    required = frag["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required == {"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "ringwright.dev/rack", "operator": "In", "values": ["a"]}]}]}
    assert pod_fragments(plan, Role.PS, job(), POLICY) == []


def test_summary_reads_well() -> None:
    plan = planned(ps_request(20, 1, min_new_workers=1), inventory(rack("a", 1), rack("b", 1)))
    assert plan.summary == "16 x H100 in 2 racks (a: 8, b: 8); 1 ps in a; 4 more do not fit now"
