"""The node inventory the planner works on: where each node sits and what it has free.

Built from Node and Pod objects (plain dicts, as kopf and the API hand them over), or
kept current from watch events by :class:`ringwright.operator.observe.ledger.CapacityLedger`,
then read by the pure planner. Free room is allocatable minus what bound, unfinished
pods request, which is what the scheduler itself counts.

Nodes are grouped by (GPU model, rack): the planner asks a group how many pods of one
shape it holds and the group remembers the answer, so a round with thousands of nodes
looks at each rack once, and at nodes only in the racks it chose or whose room changed.
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

from ...api.conditions import parse_time
from ...api.schedulingpolicy import NodeLabelKeys
from .resources import Resources, from_resource_list, pod_requests

if TYPE_CHECKING:
    from .constraints import NodeConstraints

DEFAULT_POD_SLOTS = 110
"""The kubelet's default ``maxPods``, for nodes whose allocatable omits ``pods``."""

_BLOCKING_EFFECTS = frozenset({"NoSchedule", "NoExecute"})
_FINISHED_PHASES = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True, slots=True)
class Taint:
    key: str
    value: str = ""
    effect: str = "NoSchedule"


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One schedulable node as the planner sees it."""

    name: str
    rack: str = ""
    """Value of the policy's rack label; "" when the node has none."""
    nvlink_domain: str = ""
    gpu_model: str = ""
    spine: str = ""
    free: Resources = field(default_factory=Resources)
    preemptible: Resources = field(default_factory=Resources)
    """Room held by pods of lower priority than a ps pod, which a ps pod may preempt."""
    taints: tuple[Taint, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    """Every label of the node, sorted: what templates' node constraints match."""


GroupKey = tuple[str, str]
"""(GPU model, rack) of a :class:`NodeGroup`."""

Tolerations = Sequence[Mapping[str, Any]]


def tolerations_key(tolerations: Tolerations) -> str:
    """A hashable stand-in for a pod's tolerations (for :meth:`NodeGroup.room`)."""
    return json.dumps([dict(t) for t in tolerations], sort_keys=True)


@dataclass(frozen=True)
class GroupRoom:
    """What one group holds for pods of one shape and tolerations."""

    admitted: int
    """Nodes whose taints the pods tolerate and whose labels their constraints allow."""
    fits: tuple[tuple[NodeInfo, int], ...]
    """(node, pods that fit) for every admitted node with room, in group order."""
    slots: int
    """Sum of ``fits``."""


class NodeGroup:
    """The nodes of one GPU model in one rack, sorted by name.

    Immutable: a change to any of its nodes makes a new group, so the answers
    :meth:`room` remembers never go stale.
    """

    def __init__(self, nodes: Iterable[NodeInfo]) -> None:
        self.nodes = tuple(sorted(nodes, key=lambda n: n.name))
        self._rooms: dict[tuple[Resources, str, NodeConstraints | None], GroupRoom] = {}
        self._lock = threading.Lock()

    def room(self, each: Resources, tolerations: Tolerations,
             key: str | None = None, constraints: NodeConstraints | None = None) -> GroupRoom:
        """How many pods needing ``each`` (with ``tolerations``, whose
        :func:`tolerations_key` is ``key``, and node ``constraints``) fit on each node;
        remembered per shape."""
        memo = (each, tolerations_key(tolerations) if key is None else key, constraints)
        with self._lock:
            known = self._rooms.get(memo)
        if known is not None:
            return known
        admitted = [n for n in self.nodes if admits(n, tolerations)
                    and (constraints is None or constraints.allows(n))]
        fits = tuple((n, s) for n in admitted if (s := n.free.count_fitting(each)) > 0)
        room = GroupRoom(len(admitted), fits, sum(s for _, s in fits))
        with self._lock:
            return self._rooms.setdefault(memo, room)


def group_nodes(nodes: Iterable[NodeInfo]) -> dict[GroupKey, NodeGroup]:
    """``nodes`` as :class:`NodeGroup` s by (GPU model, rack)."""
    members: dict[GroupKey, list[NodeInfo]] = defaultdict(list)
    for n in nodes:
        members[(n.gpu_model, n.rack)].append(n)
    return {key: NodeGroup(ns) for key, ns in members.items()}


class Inventory:
    """All schedulable nodes, by name and by (GPU model, rack) group."""

    def __init__(self, nodes: Iterable[NodeInfo] = (), *,
                 groups: Mapping[GroupKey, NodeGroup] | None = None,
                 by_name: Mapping[str, NodeInfo] | None = None) -> None:
        """From ``nodes``, or from ready ``groups`` and ``by_name`` (what the capacity
        ledger keeps up to date), which the inventory then owns unchanged."""
        if groups is None or by_name is None:
            listed = tuple(nodes)
            groups = group_nodes(listed)
            by_name = {n.name: n for n in listed}
        self._groups = groups
        self._by_name = by_name

    @cached_property
    def nodes(self) -> tuple[NodeInfo, ...]:
        """Every node, sorted by name (walks them all: the planner uses groups)."""
        return tuple(sorted(self._by_name.values(), key=lambda n: n.name))

    @property
    def by_name(self) -> Mapping[str, NodeInfo]:
        """Every node by name."""
        return self._by_name

    @property
    def groups(self) -> Mapping[GroupKey, NodeGroup]:
        """Every (GPU model, rack) group."""
        return self._groups

    def node(self, name: str) -> NodeInfo | None:
        """The node called ``name``, or None when it is gone or not schedulable."""
        return self._by_name.get(name)

    @cached_property
    def _rack_groups(self) -> dict[str, list[NodeGroup]]:
        out: dict[str, list[NodeGroup]] = defaultdict(list)
        for (_, rack), group in sorted(self._groups.items()):
            out[rack].append(group)
        return dict(out)

    def racks(self) -> list[str]:
        """Every rack value, sorted ("" for nodes without the rack label)."""
        return sorted(self._rack_groups)

    def in_rack(self, rack: str) -> tuple[NodeInfo, ...]:
        """The nodes of ``rack``, sorted by name."""
        groups = self._rack_groups.get(rack, ())
        if len(groups) == 1:
            return groups[0].nodes
        return tuple(sorted((n for g in groups for n in g.nodes), key=lambda n: n.name))


def with_pod_slots(inventory: Inventory, slots: Mapping[str, int], label: str) -> Inventory:
    """``inventory`` where a node whose ``label`` (its name without one) is a key of
    ``slots`` has at most that many free pod slots: the planner puts no more new pods
    there (each takes one slot). Itself when ``slots`` is empty."""
    if not slots:
        return inventory

    def capped(n: NodeInfo) -> NodeInfo:
        cap = slots.get(dict(n.labels).get(label, n.name))
        if cap is None or n.free.pods <= cap:
            return n
        return replace(n, free=replace(n.free, pods=max(cap, 0)))

    return Inventory(capped(n) for n in inventory.nodes)


def tolerates(tolerations: Sequence[Mapping[str, Any]], taint: Taint) -> bool:
    """Whether any of ``tolerations`` tolerates ``taint`` (core/v1 matching rules)."""
    for tol in tolerations:
        effect = tol.get("effect") or ""
        if effect and effect != taint.effect:
            continue
        key = tol.get("key") or ""
        if tol.get("operator") == "Exists":
            if not key or key == taint.key:
                return True
        elif key == taint.key and (tol.get("value") or "") == taint.value:
            return True
    return False


def admits(node: NodeInfo, tolerations: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a pod with ``tolerations`` may be scheduled onto ``node`` as far as taints go."""
    if not node.taints:
        return True
    return all(
        tolerates(tolerations, t) for t in node.taints if t.effect in _BLOCKING_EFFECTS
    )


def blocking_taints(node: NodeInfo, tolerations: Sequence[Mapping[str, Any]]) -> list[Taint]:
    """The taints of ``node`` that keep a pod with ``tolerations`` off it."""
    return [t for t in node.taints
            if t.effect in _BLOCKING_EFFECTS and not tolerates(tolerations, t)]


def inventory_from_objects(
    nodes: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    labels: NodeLabelKeys,
    gpu_resource: str,
    *,
    preemptible_below: int | None = None,
) -> Inventory:
    """Build the inventory from Node and Pod objects.

    Nodes that are cordoned or not Ready are left out: nothing new may go there.
    ``preemptible_below`` is the ps PriorityClass value; room held by pods with a
    lower ``spec.priority`` is recorded as preemptible.
    """
    used: dict[str, Resources] = defaultdict(Resources)
    preemptible: dict[str, Resources] = defaultdict(Resources)
    for pod in pods:
        spec = pod.get("spec") or {}
        node_name = spec.get("nodeName")
        if not node_name or (pod.get("status") or {}).get("phase") in _FINISHED_PHASES:
            continue
        need = pod_requests(spec, gpu_resource)
        used[node_name] = used[node_name] + need
        if preemptible_below is not None and (spec.get("priority") or 0) < preemptible_below:
            preemptible[node_name] = preemptible[node_name] + need

    infos = []
    for node in nodes:
        if not schedulable(node):
            continue
        meta = node.get("metadata") or {}
        node_labels = meta.get("labels") or {}
        allocatable = dict((node.get("status") or {}).get("allocatable") or {})
        allocatable.setdefault("pods", DEFAULT_POD_SLOTS)
        name = meta["name"]
        infos.append(
            NodeInfo(
                name=name,
                rack=node_labels.get(labels.rack, ""),
                nvlink_domain=node_labels.get(labels.nvlink_domain, ""),
                gpu_model=node_labels.get(labels.gpu_model, ""),
                spine=node_labels.get(labels.spine, "") if labels.spine else "",
                free=from_resource_list(allocatable, gpu_resource) - used[name],
                preemptible=preemptible[name],
                taints=tuple(
                    Taint(t["key"], t.get("value") or "", t.get("effect") or "")
                    for t in (node.get("spec") or {}).get("taints") or ()
                ),
                labels=tuple(sorted(node_labels.items())),
            )
        )
    infos.sort(key=lambda n: n.name)
    return Inventory(infos)


def schedulable(node: Mapping[str, Any]) -> bool:
    """Whether new pods may go to ``node``: not cordoned, and Ready (or not yet reporting)."""
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    for cond in (node.get("status") or {}).get("conditions") or ():
        if cond.get("type") == "Ready":
            return bool(cond.get("status") == "True")
    # No conditions reported yet (a freshly registered node): let the scheduler judge.
    return True


def not_ready_since(node: Mapping[str, Any]) -> float | None:
    """When a node's Ready condition turned False or Unknown; None while it is Ready (or
    reports nothing yet)."""
    for cond in (node.get("status") or {}).get("conditions") or ():
        if cond.get("type") == "Ready" and cond.get("status") != "True":
            return parse_time(cond.get("lastTransitionTime")) or 0.0
    return None
