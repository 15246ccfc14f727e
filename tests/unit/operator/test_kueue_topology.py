"""Topology-aware scheduling through Kueue: the pod template's Kueue annotation becomes the
pod set's topologyRequest, and the domains Kueue assigned narrow the placement (one
placement: the planner places inside them)."""

from __future__ import annotations

from typing import Any

from ringwright.objects import Obj
from ringwright.operator.api.schedulingpolicy import GPU_RESOURCE, RACK_LABEL, SchedulingPolicySpec
from ringwright.operator.plan.kueue import (
    admission,
    assigned_domains,
    effective_job,
    resize_slices,
)
from ringwright.operator.plan.placement.inventory import Inventory, NodeInfo
from ringwright.operator.plan.placement.placer import place
from ringwright.operator.plan.placement.resources import Resources
from ringwright.operator.plan.reconcile import Observed, plan
from tests.unit.operator.test_kueue_plan import GI, QUEUEING, admitted, published, queued
from tests.unit.operator.test_kueue_slices import first_slice
from tests.unit.operator.test_reconcile import NOW

HOST = "kubernetes.io/hostname"
NODES = Inventory(tuple(
    NodeInfo(name=f"{r}-n{i}", rack=f"rack-{r}", nvlink_domain=f"{r}-d", gpu_model="H100",
             free=Resources(64_000, 512 * GI, 8, 110),
             labels=tuple(sorted(((RACK_LABEL, f"rack-{r}"), (HOST, f"{r}-n{i}")))))
    for r in ("a", "b") for i in range(3)))
"""Two racks of three 8-GPU nodes, labelled as Kueue's topology levels read them."""


def run(body: Obj, status: Obj) -> Any:
    wl = {**published(body), "status": status}
    observed = Observed(job=body, pods=[], world=None, reports={},
                        policy=SchedulingPolicySpec(), inventory=NODES, workload=wl)
    return plan(observed, QUEUEING, NOW, place)


def with_topology(body: Obj, key: str, level: str) -> Obj:
    body["spec"]["workers"]["template"]["metadata"] = {"annotations": {key: level}}
    return body


def tas_admitted(assignment: Obj, count: int = 2) -> Obj:
    status = admitted(count)
    status["admission"]["podSetAssignments"][0]["topologyAssignment"] = assignment
    return status


# Two domains in rack-b: hosts b-n1 (one pod) and b-n2 (one pod).
IN_RACK_B: Obj = {
    "levels": [RACK_LABEL, HOST],
    "slices": [{"domainCount": 2,
                "valuesPerLevel": [{"universal": "rack-b"},
                                   {"individual": {"prefix": "b-n", "roots": ["1", "2"]}}],
                "podCounts": {"universal": 1}}],
}


def test_the_templates_annotation_is_the_pod_sets_topology_request() -> None:
    required = published(with_topology(queued(), "kueue.x-k8s.io/podset-required-topology",
                                       RACK_LABEL))
    assert required["spec"]["podSets"][0]["topologyRequest"] == {"required": RACK_LABEL}
    preferred = published(with_topology(queued(), "kueue.x-k8s.io/podset-preferred-topology",
                                        RACK_LABEL))
    assert preferred["spec"]["podSets"][0]["topologyRequest"] == {"preferred": RACK_LABEL}
    assert "topologyRequest" not in published(queued())["spec"]["podSets"][0]


def test_the_compact_assignment_reads_as_values_per_level() -> None:
    assert assigned_domains(IN_RACK_B) == ((RACK_LABEL, ("rack-b",)), (HOST, ("b-n1", "b-n2")))
    two_slices = {"levels": [RACK_LABEL], "slices": [
        {"domainCount": 1, "valuesPerLevel": [{"universal": "r1"}],
         "podCounts": {"universal": 2}},
        {"domainCount": 2, "valuesPerLevel": [{"individual": {"roots": ["r2", "r3"],
                                                               "suffix": "-x"}}],
         "podCounts": {"individual": [1, 1]}}]}
    assert assigned_domains(two_slices) == ((RACK_LABEL, ("r1", "r2-x", "r3-x")),)


def test_the_assigned_domains_narrow_every_required_affinity_term() -> None:
    body = queued()
    body["spec"]["workers"]["template"]["spec"]["affinity"] = {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "disk", "operator": "In", "values": ["ssd"]}]},
            {"matchExpressions": [{"key": "disk", "operator": "In", "values": ["nvme"]}]}]}}}
    effective = effective_job(body, admission({"status": tas_admitted(IN_RACK_B)}), {})
    terms = effective["spec"]["workers"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    inside = [{"key": RACK_LABEL, "operator": "In", "values": ["rack-b"]},
              {"key": HOST, "operator": "In", "values": ["b-n1", "b-n2"]}]
    assert [t["matchExpressions"][1:] for t in terms] == [inside, inside]


def test_pods_are_placed_on_the_nodes_kueue_assigned_only() -> None:
    # Without the assignment the planner would be free to use any node of either rack.
    result = run(queued(replicas=2, minimum=2), tas_admitted(IN_RACK_B))
    nodes = sorted(p["metadata"]["annotations"]["ringwright.dev/planned-node"]
                   for p in result.create)
    assert len(nodes) == 2 and set(nodes) <= {"b-n1", "b-n2"}, nodes
    assert result.create[0]["spec"]["containers"][0]["resources"]["limits"][GPU_RESOURCE] == "2"


def test_a_job_with_a_topology_assignment_asks_for_no_new_slice() -> None:
    body = queued(replicas=4, minimum=2)
    base = first_slice(body, tas_admitted(IN_RACK_B))
    change = resize_slices(body, base, None, admission(base), 1)
    assert change.create is None and change.resize is None
