"""The template's node constraints (nodeSelector, required node affinity, tolerations) narrow
the nodes the planner considers; a job they make impossible is refused with the constraint
named and counted."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringwright.operator.api.models import TrainingJobSpec
from ringwright.operator.api.schedulingpolicy import SchedulingPolicySpec
from ringwright.operator.plan.placement.constraints import (
    NO_CONSTRAINTS,
    ConstraintError,
    NodeConstraints,
    Requirement,
    Selector,
    narrowing,
    node_constraints,
)
from ringwright.operator.plan.placement.fragments import pod_fragments
from ringwright.operator.plan.placement.inventory import Inventory, NodeInfo, Taint
from ringwright.operator.plan.placement.planner import (
    PlacementPlan,
    PlacementRequest,
    Unschedulable,
    placement_request,
    plan_placement,
)
from ringwright.operator.plan.placement.resources import Resources

GI = 1024**3
POLICY = SchedulingPolicySpec()
WHERE = "spec.workers.template.spec"


def node(name: str, rack: str = "r", model: str = "H100", gpus: int = 8,
         taints: tuple[Taint, ...] = (), **labels: str) -> NodeInfo:
    return labelled(name, labels, rack=rack, model=model, gpus=gpus, taints=taints)


def labelled(name: str, labels: dict[str, str], *, rack: str = "r", model: str = "H100",
             gpus: int = 8, taints: tuple[Taint, ...] = ()) -> NodeInfo:
    return NodeInfo(name=name, rack=rack, nvlink_domain=f"{rack}-d", gpu_model=model,
                    free=Resources(64_000, 512 * GI, gpus, 110), taints=taints,
                    labels=tuple(sorted(labels.items())))


def affinity(*terms: list[dict[str, Any]]) -> dict[str, Any]:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": t} for t in terms]}}}


def expr(key: str, op: str, *values: str) -> dict[str, Any]:
    return {"key": key, "operator": op, **({"values": list(values)} if values else {})}


def workers(count: int, constraints: NodeConstraints = NO_CONSTRAINTS,
            tolerations: tuple[dict[str, Any], ...] = (), **kw: Any) -> PlacementRequest:
    return PlacementRequest(workers=count, min_new_workers=count,
                            worker_pod=Resources(1000, GI, 1, 1),
                            worker_constraints=constraints,
                            worker_tolerations=tolerations, **kw)


# --- matching: core/v1 semantics ---------------------------------------------------------

@pytest.mark.parametrize(("op", "values", "labels", "ok"), [
    ("In", ("a", "b"), {"k": "a"}, True),
    ("In", ("a",), {"k": "c"}, False),
    ("In", ("a",), {}, False),
    ("NotIn", ("a",), {"k": "c"}, True),
    ("NotIn", ("a",), {}, True),
    ("NotIn", ("a",), {"k": "a"}, False),
    ("Exists", (), {"k": ""}, True),
    ("Exists", (), {}, False),
    ("DoesNotExist", (), {}, True),
    ("DoesNotExist", (), {"k": "x"}, False),
    ("Gt", ("4",), {"k": "5"}, True),
    ("Gt", ("4",), {"k": "4"}, False),
    ("Gt", ("4",), {"k": "five"}, False),
    ("Gt", ("4",), {}, False),
    ("Lt", ("4",), {"k": "-1"}, True),
    ("Lt", ("4",), {"k": "4"}, False),
])
def test_requirement_matches_like_the_scheduler(op: str, values: tuple[str, ...],
                                                labels: dict[str, str], ok: bool) -> None:
    assert Requirement("k", op, values).matches(labels, "n") is ok


def test_terms_are_ored_and_their_expressions_anded() -> None:
    c = node_constraints({"affinity": affinity(
        [expr("zone", "In", "a"), expr("disk", "Exists")],
        [expr("zone", "In", "b")])}, WHERE)
    assert c.allows(node("1", zone="a", disk="ssd"))
    assert not c.allows(node("2", zone="a"))
    assert c.allows(node("3", zone="b"))
    assert not c.allows(node("4", zone="c", disk="ssd"))


def test_match_fields_select_nodes_by_name() -> None:
    c = node_constraints({"affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchFields": [expr("metadata.name", "In", "n1")]}]}}}}, WHERE)
    assert c.allows(node("n1")) and not c.allows(node("n2"))


def test_an_empty_term_matches_no_node() -> None:
    c = NodeConstraints(terms=((),))
    assert not c.allows(node("n"))


@pytest.mark.parametrize(("raw", "says"), [
    (expr("k", "Near", "a"), "operator 'Near'"),
    (expr("k", "In"), "needs at least one value"),
    (expr("k", "Exists", "a"), "takes no values"),
    (expr("k", "Gt", "x"), "exactly one integer"),
    (expr("k", "Lt", "1", "2"), "exactly one integer"),
])
def test_invalid_requirements_are_refused_with_the_path(raw: dict[str, Any], says: str) -> None:
    with pytest.raises(ConstraintError, match=says) as err:
        node_constraints({"affinity": affinity([raw])}, WHERE)
    assert "nodeSelectorTerms[0]" in str(err.value)


labels_st = st.dictionaries(st.sampled_from(["a", "b", "c"]), st.sampled_from(["0", "1", "2"]),
                            max_size=3)
req_st = st.builds(
    lambda key, op, value: Requirement(key, op, () if op in ("Exists", "DoesNotExist")
                                       else (value,)),
    st.sampled_from(["a", "b", "c"]),
    st.sampled_from(["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]),
    st.sampled_from(["0", "1", "2"]))


@given(labels_st, req_st)
def test_opposite_operators_split_every_node(labels: dict[str, str], r: Requirement) -> None:
    opposite = {"In": "NotIn", "NotIn": "In", "Exists": "DoesNotExist",
                "DoesNotExist": "Exists"}
    if r.operator in opposite:
        flipped = Requirement(r.key, opposite[r.operator], r.values)
        assert r.matches(labels, "n") != flipped.matches(labels, "n")


@given(st.lists(labels_st, min_size=1, max_size=12),
       st.lists(st.lists(req_st, min_size=1, max_size=3).map(tuple), max_size=3),
       st.dictionaries(st.sampled_from(["a", "b"]), st.sampled_from(["0", "1"]), max_size=2))
def test_planner_only_uses_allowed_nodes_and_refusals_name_a_constraint(
        node_labels: list[dict[str, str]], terms: list[tuple[Requirement, ...]],
        selector: dict[str, str]) -> None:
    nodes = [labelled(f"n{i}", lab, rack=f"r{i % 3}") for i, lab in enumerate(node_labels)]
    c = NodeConstraints(tuple(Selector(k, v) for k, v in sorted(selector.items())),
                        tuple(terms))
    allowed = {n.name for n in nodes if c.allows(n)}
    out = plan_placement(workers(1, c), Inventory(nodes), POLICY)
    if allowed:
        assert isinstance(out, PlacementPlan)
        assert {w.node for w in out.workers} <= allowed
    else:
        assert isinstance(out, Unschedulable)
        assert out.reason == "NodeConstraintsUnsatisfiable"
        assert f"leave 0 of {len(nodes)}" in out.message or (
            f"leaves 0 of {len(nodes)}" in out.message)


# --- the planner honours them -------------------------------------------------------------

def test_node_selector_narrows_the_racks_the_planner_picks() -> None:
    # Rack big would be the planner's pick by tightness/size; the selector allows only r2.
    nodes = [node(f"b{i}", rack="big") for i in range(4)] + [
        node("s0", rack="r2", disk="ssd"), node("s1", rack="r2", disk="ssd")]
    c = node_constraints({"nodeSelector": {"disk": "ssd"}}, WHERE)
    plan = plan_placement(workers(16, c), Inventory(nodes), POLICY)
    assert isinstance(plan, PlacementPlan)
    assert {w.node for w in plan.workers} == {"s0", "s1"}


def test_constraints_intersect_with_the_requested_gpu_model() -> None:
    nodes = [node("h0", disk="ssd"), node("a0", model="A100")]
    c = node_constraints({"nodeSelector": {"disk": "ssd"}}, WHERE)
    out = plan_placement(workers(1, c, gpu_model="A100"), Inventory(nodes), POLICY)
    assert isinstance(out, Unschedulable)
    assert out.reason == "NodeConstraintsUnsatisfiable"
    assert "nodeSelector disk=ssd leaves 0 of 1 schedulable nodes with" in out.message
    assert "A100" in out.message


def test_an_impossible_selector_names_the_key_and_the_count() -> None:
    nodes = [node(f"n{i}", zone="a" if i < 3 else "b") for i in range(5)]
    c = node_constraints({"nodeSelector": {"zone": "a", "disk": "nvme"},
                          "affinity": affinity([expr("zone", "NotIn", "c")])}, WHERE)
    out = plan_placement(workers(1, c), Inventory(nodes), POLICY)
    assert isinstance(out, Unschedulable)
    assert out.reason == "NodeConstraintsUnsatisfiable"
    assert out.message.startswith("the workers' nodeSelector disk=nvme leaves 0 of 5 ")
    assert "nodeSelector zone=a: 3" in out.message
    assert "required node affinity (zone NotIn [c]): 5" in out.message


def test_untolerated_taints_are_named() -> None:
    taint = Taint("dedicated", "infra", "NoSchedule")
    nodes = [node(f"n{i}", taints=(taint,)) for i in range(3)]
    out = plan_placement(workers(1), Inventory(nodes), POLICY)
    assert isinstance(out, Unschedulable)
    assert out.reason == "NodeConstraintsUnsatisfiable"
    assert "untolerated taints: dedicated=infra:NoSchedule" in out.message
    tolerating = ({"key": "dedicated", "operator": "Exists"},)
    assert isinstance(plan_placement(workers(1, tolerations=tolerating), Inventory(nodes),
                                     POLICY), PlacementPlan)


def test_room_short_on_allowed_nodes_is_capacity_with_the_count() -> None:
    nodes = [node("n0", disk="ssd"), node("n1")]
    c = node_constraints({"nodeSelector": {"disk": "ssd"}}, WHERE)
    out = plan_placement(workers(9, c), Inventory(nodes), POLICY)
    assert isinstance(out, Unschedulable)
    assert out.reason == "InsufficientCapacity"
    assert "on the 1 nodes the workers' template constraints allow" in out.message


def test_ps_pods_keep_to_their_own_constraints() -> None:
    nodes = [node("w0", gpus=8), node("p0", gpus=0, role="ps"), node("p1", gpus=0)]
    c = node_constraints({"nodeSelector": {"role": "ps"}}, "spec.ps.template.spec")
    plan = plan_placement(workers(1, ps=2, ps_constraints=c), Inventory(nodes), POLICY)
    assert isinstance(plan, PlacementPlan)
    assert {p.node for p in plan.ps} == {"p0"}
    nowhere = node_constraints({"nodeSelector": {"role": "ps", "zone": "x"}},
                               "spec.ps.template.spec")
    refused = plan_placement(workers(1, ps=1, ps_constraints=nowhere), Inventory(nodes), POLICY)
    assert isinstance(refused, Unschedulable)
    assert refused.message.startswith("the ps pods' nodeSelector zone=x leaves 0 of 3")


def test_narrowing_counts_each_constraint_alone_and_together() -> None:
    nodes = [node("a", zone="a"), node("b", zone="b", disk="ssd"), node("c", disk="ssd")]
    c = node_constraints({"nodeSelector": {"disk": "ssd"},
                          "affinity": affinity([expr("zone", "Exists")])}, WHERE)
    why = narrowing(c, (), nodes)
    assert why.considered == 3 and why.left == 1
    assert why.steps == (("nodeSelector disk=ssd", 2),
                         ("required node affinity (zone Exists)", 2))


# --- from the job spec to the pods ---------------------------------------------------------

def job_spec(template_spec: dict[str, Any]) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate({
        "gpusPerWorker": 1,
        "workers": {"replicas": 2, "min": 2, "max": 4,
                    "template": {"spec": {"containers": [{"name": "t", "image": "i"}],
                                          **template_spec}}},
    })


def test_job_template_constraints_reach_the_request_and_the_pods() -> None:
    user = affinity([expr("zone", "In", "a")])
    user["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] = [
        {"weight": 5, "preference": {"matchExpressions": [expr("disk", "Exists")]}}]
    user["podAntiAffinity"] = {"preferredDuringSchedulingIgnoredDuringExecution": []}
    spec = job_spec({"affinity": user})
    req = placement_request(spec, POLICY)
    assert isinstance(req, PlacementRequest)
    nodes = [node("n0", rack="r1", zone="b"), node("n1", rack="r2", zone="a")]
    plan = plan_placement(req, Inventory(nodes), POLICY)
    assert isinstance(plan, PlacementPlan)
    assert {w.node for w in plan.workers} == {"n1"}
    (fragment, _) = pod_fragments(plan, plan.workers[0].role, spec, POLICY)
    got = fragment["affinity"]
    assert got["podAntiAffinity"] == user["podAntiAffinity"]
    terms = got["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    # The plan's model and rack AND the user's zone, in every term.
    assert terms and all(expr("zone", "In", "a") in t["matchExpressions"] for t in terms)
    assert all(any(e["key"].endswith("rack") for e in t["matchExpressions"]) for t in terms)
    assert {"weight": 5, "preference": {"matchExpressions": [expr("disk", "Exists")]}} in got[
        "nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]


def test_an_invalid_template_constraint_is_refused_before_planning() -> None:
    spec = job_spec({"affinity": affinity([expr("gpus", "Gt", "many")])})
    out = placement_request(spec, POLICY)
    assert isinstance(out, Unschedulable)
    assert out.reason == "InvalidNodeConstraint"
    assert "spec.workers.template.spec.affinity" in out.message

