"""The placement planner: which GPU model, racks, NVLink domains and nodes a job's new pods get.

:func:`plan_placement` is pure: (what to place, the node inventory, the policy) →
a :class:`PlacementPlan` or :class:`Unschedulable`. It never binds anything: the plan
becomes node affinity on the pods (see :mod:`ringwright.operator.plan.placement.fragments`)
and the real kube-scheduler binds them inside it.

Rules, in order of importance:

1. one GPU model for the whole job (the one it already runs on, the requested one,
   or the allowed model that holds the most workers in the fewest racks);
2. gang: at least ``min_new_workers`` fit at once, or nothing is planned;
3. the fewest racks (within the rack limit), the job's current racks first, then the
   tightest fit; inside each rack the fewest NVLink domains, then the fewest nodes;
4. ps pods in the workers' racks, else in racks under the same spine switch, else
   anywhere; spread over nodes; when nothing is free, on room held by lower-priority
   pods, which the ps PriorityClass may preempt.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ...api.models import RackPacking, TrainingJobSpec
from ...api.schedulingpolicy import (
    NodeLabelKeys,
    PriorityClasses,
    SchedulingPolicySpec,
)
from .constraints import (
    NO_CONSTRAINTS,
    ConstraintError,
    NodeConstraints,
    narrowing,
    node_constraints,
)
from .inventory import (
    GroupRoom,
    Inventory,
    NodeInfo,
    admits,
    tolerations_key,
)
from .packing import fill
from .podresources import ps_pod_spec, worker_pod_spec
from .resources import Resources, pod_requests


class Role(StrEnum):
    WORKER = "worker"
    PS = "ps"


@dataclass(frozen=True)
class PlacementRequest:
    """What to place now; :func:`placement_request` builds it from a job."""

    workers: int
    """New worker pods wanted."""
    worker_pod: Resources
    """What one worker pod takes from a node (GPUs included)."""
    min_new_workers: int = 0
    """Gang: fewest new workers that must fit at once (0 once the job holds ``min``)."""
    gpu_model: str | None = None
    """The model the job asked for; None lets the planner choose."""
    worker_tolerations: tuple[Mapping[str, Any], ...] = ()
    worker_constraints: NodeConstraints = NO_CONSTRAINTS
    """The worker template's nodeSelector (with a Kueue flavor's node labels, see
    :mod:`ringwright.operator.plan.kueue`) and required node affinity: only nodes they
    allow are considered."""
    ps: int = 0
    """New ps pods wanted."""
    ps_pod: Resources = field(default_factory=lambda: Resources(pods=1))
    ps_tolerations: tuple[Mapping[str, Any], ...] = ()
    ps_constraints: NodeConstraints = NO_CONSTRAINTS
    current_worker_nodes: tuple[str, ...] = ()
    """Nodes of the job's bound worker pods: their model, racks and nodes come first."""
    current_ps_nodes: tuple[str, ...] = ()
    max_racks: int | None = None
    """The tighter of the job's and the policy's rack bound."""
    rack_packing: RackPacking = RackPacking.REQUIRED


@dataclass(frozen=True)
class PodPlacement:
    """Where the planner intends one new pod to go."""

    role: Role
    node: str
    rack: str
    nvlink_domain: str
    preempts: bool = False
    """True for a ps pod planned onto room that lower-priority pods hold now."""


@dataclass(frozen=True)
class PlacementPlan:
    """Where the new pods go, plus what the pod builders need to say so."""

    gpu_model: str
    """The job's one GPU model; "" for a CPU-only job."""
    racks: tuple[str, ...]
    """Every rack the job's workers use once this plan is applied, sorted."""
    workers: tuple[PodPlacement, ...]
    """New workers, in ring order (rack, NVLink domain, node)."""
    ps: tuple[PodPlacement, ...]
    shortfall: int
    """Workers asked for that do not fit now (the job runs with fewer, at least ``min``)."""
    packing: RackPacking
    labels: NodeLabelKeys
    priority_classes: PriorityClasses
    ps_racks: tuple[str, ...] = ()

    @property
    def summary(self) -> str:
        """One line for events and logs, e.g. ``16 x H100 in 2 racks (r1: 8, r2: 8)``."""
        per_rack: dict[str, int] = defaultdict(int)
        for w in self.workers:
            per_rack[w.rack] += 1
        racks = ", ".join(f"{r or '<no rack>'}: {n}" for r, n in sorted(per_rack.items()))
        model = self.gpu_model or "CPU"
        text = f"{len(self.workers)} x {model} in {len(per_rack)} racks ({racks})"
        if self.ps:
            text += f"; {len(self.ps)} ps in {', '.join(self.ps_racks) or '<no rack>'}"
        if self.shortfall:
            text += f"; {self.shortfall} more do not fit now"
        return text


@dataclass(frozen=True)
class Unschedulable:
    """Nothing may be created: the reason for a condition, in numbers."""

    reason: str
    """CamelCase, for the condition's ``reason``."""
    message: str


def placement_request(
    spec: TrainingJobSpec,
    policy: SchedulingPolicySpec,
    *,
    current_workers: Sequence[str] = (),
    current_ps: Sequence[str] = (),
) -> PlacementRequest | Unschedulable:
    """What to place for ``spec`` now, given the job's existing pods.

    ``current_workers`` / ``current_ps`` hold the node name of each existing pod of
    that role ("" while unbound). A job asking for more than the policy's limits is
    refused as a whole, so the user sees which limit to respect.
    """
    limits = policy.limits
    if spec.workers.replicas > limits.max_workers_per_job:
        return Unschedulable(
            "ExceedsPolicyLimit",
            f"spec.workers.replicas is {spec.workers.replicas} but the SchedulingPolicy "
            f"allows {limits.max_workers_per_job} workers per job (limits.maxWorkersPerJob)",
        )
    ps_wanted = spec.ps.replicas if spec.ps is not None else 0
    if ps_wanted > limits.max_ps_per_job:
        return Unschedulable(
            "ExceedsPolicyLimit",
            f"spec.ps.replicas is {ps_wanted} but the SchedulingPolicy allows "
            f"{limits.max_ps_per_job} ps pods per job (limits.maxPsPerJob)",
        )
    worker_spec = worker_pod_spec(
        spec.workers.template.spec.to_wire(), spec.gpus_per_worker, policy.gpu_resource
    )
    ps_pod = Resources(pods=1)
    ps_tolerations: tuple[Mapping[str, Any], ...] = ()
    ps_constraints = NO_CONSTRAINTS
    try:
        worker_constraints = node_constraints(worker_spec, "spec.workers.template.spec")
        if spec.ps is not None:
            ps_spec = ps_pod_spec(spec.ps.template.spec.to_wire(), policy.ps_pinning)
            ps_pod = pod_requests(ps_spec, policy.gpu_resource)
            ps_tolerations = tuple(ps_spec.get("tolerations") or ())
            ps_constraints = node_constraints(ps_spec, "spec.ps.template.spec")
    except ConstraintError as err:
        return Unschedulable("InvalidNodeConstraint", f"{err}; fix the template")
    bounds = [b for b in (spec.topology.max_racks, limits.max_racks_per_job) if b is not None]
    packing = RackPacking.PREFERRED
    if RackPacking.REQUIRED in (spec.topology.rack_packing, policy.rack_packing):
        packing = RackPacking.REQUIRED
    return PlacementRequest(
        workers=max(0, spec.workers.replicas - len(current_workers)),
        min_new_workers=max(0, spec.workers.min - len(current_workers)),
        worker_pod=pod_requests(worker_spec, policy.gpu_resource),
        gpu_model=spec.gpu_model,
        worker_tolerations=tuple(worker_spec.get("tolerations") or ()),
        worker_constraints=worker_constraints,
        ps=max(0, ps_wanted - len(current_ps)),
        ps_pod=ps_pod,
        ps_tolerations=ps_tolerations,
        ps_constraints=ps_constraints,
        current_worker_nodes=tuple(n for n in current_workers if n),
        current_ps_nodes=tuple(n for n in current_ps if n),
        max_racks=min(bounds) if bounds else None,
        rack_packing=packing,
    )


@dataclass
class _Outcome:
    model: str
    picks: list[tuple[NodeInfo, int]] = field(default_factory=list)
    placed: int = 0
    racks: frozenset[str] = frozenset()
    room: int = 0
    """Free worker slots in the chosen racks, before placing: tightness."""


def plan_placement(
    request: PlacementRequest, inventory: Inventory, policy: SchedulingPolicySpec
) -> PlacementPlan | Unschedulable:
    """Plan where ``request``'s new pods go; pure and deterministic."""
    current = [n for n in map(inventory.node, request.current_worker_nodes) if n is not None]
    # One remembered answer per (model, rack) group: no walk over every node per round.
    tolerated = tolerations_key(request.worker_tolerations)
    constraints = None if request.worker_constraints.empty else request.worker_constraints
    rooms = {key: group.room(request.worker_pod, request.worker_tolerations, tolerated,
                             constraints)
             for key, group in inventory.groups.items()}
    present = sorted({model for (model, _), room in rooms.items() if model and room.admitted})
    models = _candidate_models(request, present, policy, current)
    if isinstance(models, Unschedulable):
        if models.reason == "NoGPUNodes":
            return _constrained(request, inventory, policy) or models
        return models
    if not any(room.admitted for (m, _), room in rooms.items() if m in models or models == [""]):
        # Nothing here can ever hold a worker: say which constraint, not "no room".
        refused = _constrained(request, inventory, policy, models)
        if refused is not None:
            return refused
    outcomes = [
        _place_workers(
            request,
            [(rack, room) for (m, rack), room in rooms.items() if not model or m == model],
            model,
            current,
        )
        for model in models
    ]
    # Most workers placed, then fewest racks, then the admin's order, then tightest fit.
    best = min(
        enumerate(outcomes),
        key=lambda io: (-io[1].placed, len(io[1].racks), io[0], io[1].room - io[1].placed),
    )[1]
    if best.placed < request.min_new_workers:
        return _no_room(request, outcomes, rooms)

    workers = tuple(
        PodPlacement(Role.WORKER, node.name, node.rack, node.nvlink_domain)
        for node, take in sorted(best.picks, key=lambda p: _ring_key(p[0]))
        for _ in range(take)
    )
    taken = {node.name: request.worker_pod.times(take) for node, take in best.picks}
    ps = _place_ps(request, inventory, best.racks, taken)
    if len(ps) < request.ps:
        ps_nodes = [n for n in inventory.nodes if admits(n, request.ps_tolerations)
                    and request.ps_constraints.allows(n)]
        if not ps_nodes:
            why = narrowing(request.ps_constraints, request.ps_tolerations, inventory.nodes)
            return Unschedulable(
                UNSATISFIABLE, why.message("ps pods", "schedulable nodes") + HINT)
        return Unschedulable(
            "InsufficientCapacity",
            f"needs {request.ps} ps pods ({request.ps_pod.describe()} each); the cluster has "
            f"room for {len(ps)}, counting pods of lower priority they may preempt",
        )
    return PlacementPlan(
        gpu_model=best.model,
        racks=tuple(sorted(best.racks)),
        workers=workers,
        ps=ps,
        ps_racks=tuple(sorted({p.rack for p in ps})),
        shortfall=request.workers - best.placed,
        packing=request.rack_packing,
        labels=policy.node_labels,
        priority_classes=policy.priority_classes,
    )


def _candidate_models(
    request: PlacementRequest,
    present: list[str],
    policy: SchedulingPolicySpec,
    current: Sequence[NodeInfo],
) -> list[str] | Unschedulable:
    if request.worker_pod.gpus == 0:
        return [""]
    allowed = policy.allowed_gpu_models
    if request.gpu_model is not None:
        if allowed and request.gpu_model not in allowed:
            return Unschedulable(
                "GPUModelNotAllowed",
                f"spec.gpuModel {request.gpu_model} is not allowed by the SchedulingPolicy "
                f"(allowed: {', '.join(allowed)})",
            )
        return [request.gpu_model]
    running_on = sorted({n.gpu_model for n in current if n.gpu_model})
    if running_on:
        # Homogeneity across resizes: a job never mixes models.
        return running_on[:1]
    if allowed:
        return list(allowed)
    if not present:
        return Unschedulable(
            "NoGPUNodes",
            f"no schedulable node that admits the workers has the GPU model label "
            f"{policy.node_labels.gpu_model}",
        )
    return present


def _place_workers(
    request: PlacementRequest,
    groups: Sequence[tuple[str, GroupRoom]],
    model: str,
    current: Sequence[NodeInfo],
) -> _Outcome:
    """Place the workers on ``groups`` ((rack, room) of ``model``'s nodes that admit them)."""
    rack_room: dict[str, int] = {}
    for rack, room in groups:
        if room.slots > 0:
            rack_room[rack] = rack_room.get(rack, 0) + room.slots

    cur_racks = {n.rack for n in current}
    cur_domains = {n.nvlink_domain for n in current}
    cur_nodes = {n.name for n in current}
    extra = None
    if request.max_racks is not None:
        extra = max(0, request.max_racks - len(cur_racks))
    rack_picks = fill(
        list(rack_room.items()), request.workers, preferred=cur_racks, extra_limit=extra
    )
    outcome = _Outcome(model, racks=frozenset(cur_racks | {r for r, _ in rack_picks}))
    chosen = {r for r, _ in rack_picks}
    # Only the chosen racks are looked at node by node.
    domains: dict[str, dict[str, list[tuple[NodeInfo, int]]]] = {r: {} for r in chosen}
    for rack, room in groups:
        if rack in chosen:
            for node, slots in room.fits:
                domains[rack].setdefault(node.nvlink_domain, []).append((node, slots))
    for rack, rack_take in rack_picks:
        outcome.room += rack_room[rack]
        members = domains[rack]
        domain_room = [(d, sum(s for _, s in ns)) for d, ns in members.items()]
        for domain, domain_take in fill(domain_room, rack_take, preferred=cur_domains):
            by_name = {node.name: node for node, _ in members[domain]}
            node_room = [(node.name, s) for node, s in members[domain]]
            for name, take in fill(node_room, domain_take, preferred=cur_nodes):
                outcome.picks.append((by_name[name], take))
                outcome.placed += take
    return outcome


def _place_ps(
    request: PlacementRequest,
    inventory: Inventory,
    worker_racks: frozenset[str],
    taken: Mapping[str, Resources],
) -> tuple[PodPlacement, ...]:
    if request.ps == 0:
        return ()
    current = [n for n in map(inventory.node, request.current_ps_nodes) if n is not None]
    home = sorted(set(worker_racks) | {n.rack for n in current})
    spines = {n.spine for r in home for n in inventory.in_rack(r) if n.spine}
    others = [r for r in inventory.racks() if r not in home]
    near = [r for r in others if spines and any(n.spine in spines for n in inventory.in_rack(r))]
    far = [r for r in others if r not in set(near)]
    # Free room near the workers first, then room that lower-priority pods hold near
    # them (the ps PriorityClass preempts those), and only then racks farther away:
    # a ps pod's traffic goes to every worker, so distance costs every step.
    passes = [
        (home, False), (near, False), (home, True), (near, True), (far, False), (far, True)
    ]
    placed: list[PodPlacement] = []
    per_node: Counter[str] = Counter()
    for racks, preempt in passes:
        room = {}
        for rack in racks:
            for node in inventory.in_rack(rack):
                if not admits(node, request.ps_tolerations) or not (
                        request.ps_constraints.allows(node)):
                    continue
                free = node.free
                if node.name in taken:
                    free = free - taken[node.name]
                if preempt:
                    free = free + node.preemptible
                left = free.count_fitting(request.ps_pod) - per_node[node.name]
                if left > 0:
                    room[node] = left
        # Round-robin over the nodes, roomiest first: ps pods are bandwidth-bound,
        # so two should not share a NIC while another node has room.
        ring = sorted(room, key=lambda n: (-room[n], n.name))
        while ring and len(placed) < request.ps:
            for node in ring[: request.ps - len(placed)]:
                placed.append(PodPlacement(Role.PS, node.name, node.rack, "", preempt))
                per_node[node.name] += 1
                room[node] -= 1
            ring = [n for n in ring if room[n] > 0]
        if len(placed) == request.ps:
            break
    return tuple(placed)


def _ring_key(node: NodeInfo) -> tuple[str, str, str]:
    return (node.rack, node.nvlink_domain, node.name)


UNSATISFIABLE = "NodeConstraintsUnsatisfiable"
"""Condition reason: the template's node constraints leave no node the job may use."""
HINT = ("; loosen that constraint in the template, or label or untaint nodes to match")


def _constrained(request: PlacementRequest, inventory: Inventory,
                 policy: SchedulingPolicySpec,
                 models: Sequence[str] = ()) -> Unschedulable | None:
    """The refusal when the workers' constraints leave no node of ``models`` (any node
    when empty), naming the tightest constraint; None when they are not the cause."""
    if request.worker_constraints.empty and not request.worker_tolerations and not any(
            n.taints for n in inventory.nodes):
        return None
    key = policy.node_labels.gpu_model
    chosen = [m for m in models if m]
    nodes = [n for n in inventory.nodes if not chosen or n.gpu_model in chosen]
    if not nodes:
        return None  # no node of the model at all: capacity, not a constraint
    why = narrowing(request.worker_constraints, request.worker_tolerations, nodes)
    if why.left > 0 or not why.steps:
        return None
    scope = (f"schedulable nodes with {key} in [{', '.join(chosen)}]" if chosen
             else "schedulable nodes")
    return Unschedulable(UNSATISFIABLE, why.message("workers", scope) + HINT)


def _no_room(request: PlacementRequest, outcomes: Sequence[_Outcome],
             rooms: Mapping[tuple[str, str], GroupRoom]) -> Unschedulable:
    within = f" within {request.max_racks} racks" if request.max_racks is not None else ""
    tried = sorted(outcomes, key=lambda o: (-o.placed, o.model))
    best = tried[0]
    model = f"{best.model} " if best.model else ""
    racks = f"best {len(best.racks)}-rack set" if best.racks else "the cluster"
    message = (
        f"needs {request.min_new_workers} x {model}workers ({request.worker_pod.describe()} "
        f"each){within}; {racks} has room for {best.placed}"
    )
    if len(tried) > 1:
        message += "; other models: " + ", ".join(
            f"{o.model} room for {o.placed}" for o in tried[1:]
        )
    if not request.worker_constraints.empty:
        allowed = sum(r.admitted for (m, _), r in rooms.items() if m == best.model)
        message += (f" on the {allowed} nodes the workers' template constraints allow "
                    "(nodeSelector, required node affinity, tolerations)")
    return Unschedulable("InsufficientCapacity", message)
