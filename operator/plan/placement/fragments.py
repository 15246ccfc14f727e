"""Turning a placement plan into pod-spec fragments the real scheduler acts on.

Required node affinity pins the job's GPU model and (with Required packing) its rack
set; preferred terms point each pod at the node, NVLink domain and rack the planner
chose, so the scheduler's NodeAffinity score steers it there while still letting it
bind elsewhere inside the required set when the picture changed since planning.

The template's own affinity is kept: its required node affinity is ANDed with the
plan's (the planner only chose nodes it allows), its preferred terms and its pod
(anti-)affinity stay as written.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from ...api.models import RackPacking, TrainingJobSpec
from ...api.schedulingpolicy import SchedulingPolicySpec
from .planner import PlacementPlan, PodPlacement, Role
from .podresources import (
    ps_container_resources,
    ps_pod_spec,
    worker_container_resources,
)

NODE_WEIGHT = 100
DOMAIN_WEIGHT = 60
RACK_WEIGHT = 30
RACK_SET_WEIGHT = 80
"""Weights of preferred terms (1-100): the planned node first, then its NVLink domain."""


def _expr(key: str, operator: str, values: list[str] | None = None) -> dict[str, Any]:
    expr: dict[str, Any] = {"key": key, "operator": operator}
    if values is not None:
        expr["values"] = values
    return expr


def _rack_terms(key: str, racks: tuple[str, ...]) -> list[list[dict[str, Any]]]:
    """Alternatives (ORed) that select nodes in ``racks``; "" stands for unlabelled nodes."""
    named = [r for r in racks if r]
    terms = [[_expr(key, "In", named)]] if named else []
    if "" in racks:
        terms.append([_expr(key, "DoesNotExist")])
    return terms


def node_affinity(plan: PlacementPlan, pod: PodPlacement,
                  template: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``nodeAffinity`` of one new pod; ``template`` is its template's own."""
    labels = plan.labels
    base: list[dict[str, Any]] = []
    if pod.role == Role.WORKER and plan.gpu_model:
        base.append(_expr(labels.gpu_model, "In", [plan.gpu_model]))
    racks = plan.racks if pod.role == Role.WORKER else plan.ps_racks
    preferred: list[dict[str, Any]] = [
        {
            "weight": NODE_WEIGHT,
            "preference": {"matchFields": [_expr("metadata.name", "In", [pod.node])]},
        }
    ]
    if pod.nvlink_domain:
        preferred.append({
            "weight": DOMAIN_WEIGHT,
            "preference": {"matchExpressions": [
                _expr(labels.nvlink_domain, "In", [pod.nvlink_domain])
            ]},
        })
    if pod.rack:
        preferred.append({
            "weight": RACK_WEIGHT,
            "preference": {"matchExpressions": [_expr(labels.rack, "In", [pod.rack])]},
        })

    rack_terms = _rack_terms(labels.rack, racks)
    required_terms = [base]
    if plan.packing == RackPacking.REQUIRED and rack_terms:
        required_terms = [base + term for term in rack_terms]
    else:
        preferred.extend(
            {"weight": RACK_SET_WEIGHT, "preference": {"matchExpressions": term}}
            for term in rack_terms
        )
    own = template or {}
    preferred.extend(copy.deepcopy(own.get("preferredDuringSchedulingIgnoredDuringExecution")
                                   or []))
    affinity: dict[str, Any] = {"preferredDuringSchedulingIgnoredDuringExecution": preferred}
    terms = [{"matchExpressions": term} for term in required_terms]
    users = (own.get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get(
        "nodeSelectorTerms") or []
    if users:
        # Terms are ORed, expressions inside one ANDed: (plan AND user) for every pair.
        terms = [_and(plan_term, user) for plan_term in terms for user in users]
    if any(t.get("matchExpressions") or t.get("matchFields") for t in terms):
        affinity["requiredDuringSchedulingIgnoredDuringExecution"] = {"nodeSelectorTerms": terms}
    return affinity


def _and(plan_term: Mapping[str, Any], user: Mapping[str, Any]) -> dict[str, Any]:
    term: dict[str, Any] = {"matchExpressions": [*plan_term["matchExpressions"],
                                                 *copy.deepcopy(user.get("matchExpressions")
                                                                or [])]}
    if user.get("matchFields"):
        term["matchFields"] = copy.deepcopy(user["matchFields"])
    return term


def placement_fragment(
    plan: PlacementPlan, pod: PodPlacement, resources: dict[str, Any],
    template_affinity: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Pod-spec fields for one new pod: affinity (the template's, with the plan's node
    affinity joined in), priority class, training-container resources, and
    ``plannedNode`` (not a pod-spec field: it becomes the planned-node annotation)."""
    classes = plan.priority_classes
    own = dict(template_affinity or {})
    return {
        "plannedNode": pod.node,
        "affinity": {**copy.deepcopy(own),
                     "nodeAffinity": node_affinity(plan, pod, own.get("nodeAffinity"))},
        "priorityClassName": classes.worker if pod.role == Role.WORKER else classes.ps,
        "resources": copy.deepcopy(resources),
    }


def pod_fragments(
    plan: PlacementPlan, role: Role, spec: TrainingJobSpec, policy: SchedulingPolicySpec
) -> list[dict[str, Any]]:
    """One :func:`placement_fragment` per new pod of ``role``, workers in ring order.

    ``resources`` is for the first (training) container; ps fragments also carry
    ``containerResources``, every container's pinned resources by name.
    """
    if role == Role.WORKER:
        first = spec.workers.template.spec.containers[0]
        resources = worker_container_resources(
            first.get("resources"), spec.gpus_per_worker, policy.gpu_resource
        )
        own = spec.workers.template.spec.to_wire().get("affinity")
        return [placement_fragment(plan, p, resources, own) for p in plan.workers]
    if spec.ps is None:
        return []
    first = spec.ps.template.spec.containers[0]
    resources = ps_container_resources(first.get("resources"), policy.ps_pinning)
    # Every container, init containers too: a pod is Guaranteed only when all are.
    pinned = ps_pod_spec(spec.ps.template.spec.to_wire(), policy.ps_pinning)
    per_container = {c["name"]: c.get("resources") or {} for key in ("initContainers",
                     "containers") for c in pinned.get(key) or ()}
    own = pinned.get("affinity")
    return [{**placement_fragment(plan, p, resources, own),
             "containerResources": copy.deepcopy(per_container)} for p in plan.ps]
