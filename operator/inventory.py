"""The node inventory the planner works on: where each node sits and what it has free.

Built once per reconcile from Node and Pod objects (plain dicts, as kopf and the API
hand them over), then read by the pure planner. Free room is allocatable minus what
bound, unfinished pods request, which is what the scheduler itself counts.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ringwright.operator.conditions import parse_time
from ringwright.operator.resources import Resources, from_resource_list, pod_requests
from ringwright.operator.schedulingpolicy import NodeLabelKeys

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


@dataclass(frozen=True)
class Inventory:
    """All schedulable nodes, in a stable order."""

    nodes: tuple[NodeInfo, ...]
    _by_name: dict[str, NodeInfo] = field(init=False, repr=False, compare=False)
    _by_rack: dict[str, tuple[NodeInfo, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_rack: dict[str, list[NodeInfo]] = defaultdict(list)
        for n in self.nodes:
            by_rack[n.rack].append(n)
        object.__setattr__(self, "_by_name", {n.name: n for n in self.nodes})
        object.__setattr__(self, "_by_rack", {r: tuple(ns) for r, ns in by_rack.items()})

    def node(self, name: str) -> NodeInfo | None:
        """The node called ``name``, or None when it is gone or not schedulable."""
        return self._by_name.get(name)

    def racks(self) -> list[str]:
        """Every rack value, sorted ("" for nodes without the rack label)."""
        return sorted(self._by_rack)

    def in_rack(self, rack: str) -> tuple[NodeInfo, ...]:
        """The nodes of ``rack``, in inventory order."""
        return self._by_rack.get(rack, ())


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
            )
        )
    infos.sort(key=lambda n: n.name)
    return Inventory(tuple(infos))


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
