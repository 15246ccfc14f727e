"""Topology-aware scheduling through Kueue: the pod template's Kueue annotation becomes the
pod set's topologyRequest, and the domains Kueue assigned narrow the placement (one
placement: the planner places inside them)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from ringwright.objects import Obj
from ringwright.operator.api.schedulingpolicy import GPU_RESOURCE, RACK_LABEL, SchedulingPolicySpec
from ringwright.operator.plan.kueue import (
    admission,
    assigned_domains,
    effective_job,
    resize_slices,
)
from ringwright.operator.plan.kueue_topology import fit, read_assignment, request_kind
from ringwright.operator.plan.placement.inventory import Inventory, NodeInfo
from ringwright.operator.plan.placement.placer import place
from ringwright.operator.plan.placement.resources import Resources
from ringwright.operator.plan.reconcile import Observed, plan
from tests.unit.operator.test_kueue_plan import GI, QUEUEING, admitted, published, queued
from tests.unit.operator.test_kueue_slices import first_slice
from tests.unit.operator.test_reconcile import NOW, pod, world_of

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


def test_a_job_with_a_topology_assignment_asks_for_no_new_slice_and_says_why() -> None:
    body = queued(replicas=4, minimum=2)
    base = first_slice(body, tas_admitted(IN_RACK_B))
    change = resize_slices(body, base, None, admission(base), 1)
    assert change.create is None and change.resize is None
    assert "asked for 4 workers but Kueue admitted 2" in change.fixed
    assert "ElasticJobsViaWorkloadSlicesWithTAS" in change.fixed


# Three hosts of rack-a: a-n0 (two pods), a-n1 and a-n2 (one pod each).
THREE_HOSTS: Obj = {
    "levels": [RACK_LABEL, HOST],
    "slices": [{"domainCount": 3,
                "valuesPerLevel": [{"universal": "rack-a"},
                                   {"individual": {"prefix": "a-n", "roots": ["0", "1", "2"]}}],
                "podCounts": {"individual": [2, 1, 1]}}],
}
UNCONSTRAINED = "kueue.x-k8s.io/podset-unconstrained-topology"
GATED = QUEUEING.model_copy(update={"kueue_elastic": True, "kueue_elastic_topology": True})


def test_the_assignment_reads_with_each_domains_pod_count() -> None:
    assigned = read_assignment(THREE_HOSTS)
    assert assigned.domains == ((("rack-a", "a-n0"), 2), (("rack-a", "a-n1"), 1),
                                (("rack-a", "a-n2"), 1))
    assert read_assignment(IN_RACK_B).domains == ((("rack-b", "b-n1"), 1),
                                                  (("rack-b", "b-n2"), 1))


def test_new_pods_go_to_the_domains_with_room_and_the_extra_pods_are_surplus() -> None:
    on = {name: {RACK_LABEL: "rack-a", HOST: name} for name in ("a-n0", "a-n1", "a-n2")}
    on["b-n0"] = {RACK_LABEL: "rack-b", HOST: "b-n0"}
    found = fit(read_assignment(THREE_HOSTS), [("p0", on["a-n0"]), ("p1", on["a-n1"]),
                                                ("p2", on["a-n1"]), ("p3", on["b-n0"])])
    # a-n0 holds one of its two, a-n2 none of its one; a-n1 holds one too many.
    assert found.room == ((RACK_LABEL, ("rack-a",)), (HOST, ("a-n0", "a-n2")))
    assert found.surplus == {"p2", "p3"}
    assert found.host_room == (("a-n0", 1), ("a-n1", 0), ("a-n2", 1))
    full = fit(read_assignment(IN_RACK_B), [("p0", {HOST: "b-n1", RACK_LABEL: "rack-b"}),
                                             ("p1", {HOST: "b-n2", RACK_LABEL: "rack-b"})])
    assert full.room == read_assignment(IN_RACK_B).values() and not full.surplus


def test_the_unconstrained_annotation_is_a_boolean_request() -> None:
    body = with_topology(queued(), UNCONSTRAINED, "true")
    assert published(body)["spec"]["podSets"][0]["topologyRequest"] == {"unconstrained": True}
    assert request_kind(published(body)["spec"]["podSets"][0]) == "unconstrained"
    assert request_kind(published(queued())["spec"]["podSets"][0]) == "implied"


def test_with_the_gate_an_unconstrained_job_grows_and_shrinks_through_slices() -> None:
    body = with_topology(queued(replicas=6, minimum=2), UNCONSTRAINED, "true")
    base = first_slice(body, tas_admitted(THREE_HOSTS, count=4), count=4)
    grow = resize_slices(body, base, None, admission(base), 1, topology_slices=True)
    assert grow.create is not None and not grow.fixed and grow.keep is None
    assert grow.create["spec"]["podSets"][0]["count"] == 6
    # Fewer: a smaller slice (Kueue keeps an in-place shrink's assignment at the old
    # size), and the four workers stay until its assignment says which.
    body["spec"]["workers"]["replicas"] = 3
    shrink = resize_slices(body, base, None, admission(base), 1, topology_slices=True)
    assert shrink.resize is None and shrink.keep == 4
    assert shrink.create is not None and shrink.create["spec"]["podSets"][0]["count"] == 3


def test_with_the_gate_a_required_request_admitted_without_topology_keeps_its_size() -> None:
    # Kueue v0.17 under the gate admits a required request on quota alone.
    body = with_topology(queued(replicas=6, minimum=2),
                         "kueue.x-k8s.io/podset-required-topology", RACK_LABEL)
    base = first_slice(body, admitted(4), count=4)
    change = resize_slices(body, base, None, admission(base), 1, topology_slices=True)
    assert change.create is None and change.resize is None
    assert "admits a required request without the topology it asks for" in change.fixed
    result = gated(body, admitted(4), [])
    dropped = next(c for c in result.status["conditions"] if c["type"] == "TopologyAssigned")
    assert (dropped["status"], dropped["reason"]) == ("False", "KueueDroppedRequest")
    assert f"workers (required: {RACK_LABEL})" in dropped["message"]
    assert len(result.create) == 4  # placed by the operator's own rules, as admitted


def racked(index: int, node: str) -> Obj:
    return pod(index, node=node)


THREE_HOST_NODES = Inventory(tuple(
    NodeInfo(name=f"a-n{i}", rack="rack-a", nvlink_domain="a-d", gpu_model="H100",
             free=Resources(64_000, 512 * GI, 8, 110),
             labels=tuple(sorted(((RACK_LABEL, "rack-a"), (HOST, f"a-n{i}")))))
    for i in range(4)))


def gated(body: Obj, status: Obj, pods: list[Obj], world: Any = None) -> Any:
    wl = first_slice(body, status, count=status["admission"]["podSetAssignments"][0]["count"])
    observed = Observed(job=body, pods=pods, world=world, reports={},
                        policy=SchedulingPolicySpec(), inventory=THREE_HOST_NODES, workload=wl)
    return plan(observed, GATED, NOW, place)


def test_a_grown_slices_new_pod_goes_to_the_host_kueue_added() -> None:
    body = with_topology(queued(replicas=4, minimum=2), UNCONSTRAINED, "true")
    # Three running: two on a-n0, one on a-n1; Kueue's grown slice adds a-n2.
    pods = [racked(0, "a-n0"), racked(1, "a-n0"), racked(2, "a-n1")]
    result = gated(body, tas_admitted(THREE_HOSTS, count=4), pods, world_of([0, 1, 2]))
    (created,) = result.create
    assert created["metadata"]["annotations"]["ringwright.dev/planned-node"] == "a-n2"


def test_new_pods_go_to_each_host_as_many_as_kueue_counted_there() -> None:
    body = with_topology(queued(replicas=4, minimum=1), UNCONSTRAINED, "true")
    # One running on a-n1; Kueue counted two more on a-n0 and one on a-n2. Every host
    # has room for four, and the planner packs: only the counts keep it from a 3 or 1+2.
    result = gated(body, tas_admitted(THREE_HOSTS, count=4), [racked(0, "a-n1")],
                   world_of([0]))
    planned = Counter(p["metadata"]["annotations"]["ringwright.dev/planned-node"]
                      for p in result.create)
    assert planned == {"a-n0": 2, "a-n2": 1}, planned


def test_on_a_smaller_slice_the_pods_it_no_longer_counts_leave_first() -> None:
    body = with_topology(queued(replicas=2, minimum=2), UNCONSTRAINED, "true")
    smaller: Obj = {"levels": [RACK_LABEL, HOST], "slices": [
        {"domainCount": 1, "valuesPerLevel": [{"universal": "rack-a"}, {"universal": "a-n1"}],
         "podCounts": {"universal": 1}},
        {"domainCount": 1, "valuesPerLevel": [{"universal": "rack-a"}, {"universal": "a-n2"}],
         "podCounts": {"universal": 1}}]}
    # Rank 0 on a-n0, which Kueue dropped: it goes, not rank 2 (the highest).
    pods = [racked(0, "a-n0"), racked(1, "a-n1"), racked(2, "a-n2")]
    result = gated(body, tas_admitted(smaller, count=2), pods, world_of([0, 1, 2]))
    assert result.mark_leaving == ["tj-worker-0"]
