"""Free capacity per node, kept current from watch events instead of rebuilt per round.

The operator's watches (kopf indices) hold every Node and every pod that takes room:
a bound pod on its node, and a ringwright pod that is created but not yet bound on the
node its plan chose (so two gangs planned at the same moment never count the same free
GPUs twice). A watch event marks the nodes it touches dirty; asking for an inventory
recomputes only those nodes and reuses every other :class:`NodeInfo` as it was.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..api.schedulingpolicy import NodeLabelKeys
from ..plan.manifests import PLANNED_NODE_ANNOTATION
from ..plan.placement.inventory import (
    DEFAULT_POD_SLOTS,
    GroupKey,
    Inventory,
    NodeGroup,
    NodeInfo,
    Taint,
    not_ready_since,
    schedulable,
)
from ..plan.placement.resources import Resources, from_resource_list, pod_requests

_FINISHED_PHASES = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True)
class PodSlot:
    """What one pod holds on a node: the spec fields requests come from, its priority."""

    uid: str
    spec: Mapping[str, Any]
    priority: int
    bound: bool


def pod_slots(pod: Mapping[str, Any]) -> dict[str, PodSlot]:
    """``{node: slot}`` for a pod that takes room (empty for finished or unplaced pods)."""
    spec = pod.get("spec") or {}
    meta = pod.get("metadata") or {}
    if (pod.get("status") or {}).get("phase") in _FINISHED_PHASES:
        return {}
    node = spec.get("nodeName") or ""
    planned = (meta.get("annotations") or {}).get(PLANNED_NODE_ANNOTATION, "")
    if not node and not planned:
        return {}
    kept = {k: spec[k] for k in ("containers", "initContainers", "overhead") if k in spec}
    return {node or planned: PodSlot(str(meta.get("uid", "")), kept,
                                     int(spec.get("priority") or 0), bool(node))}


def _pod_key(pod: Mapping[str, Any]) -> tuple[str, str]:
    meta = pod.get("metadata") or {}
    return str(meta.get("namespace", "")), str(meta.get("name", ""))


def touched_nodes(pod: Mapping[str, Any]) -> set[str]:
    """Every node whose room a change of ``pod`` may alter (bound and planned)."""
    spec = pod.get("spec") or {}
    planned = ((pod.get("metadata") or {}).get("annotations") or {}).get(
        PLANNED_NODE_ANNOTATION, "")
    return {n for n in (spec.get("nodeName") or "", planned) if n}


def frees_room(pod: Mapping[str, Any], event_type: str | None) -> bool:
    """Whether this watch event of ``pod`` gives room back to the nodes it was on or planned
    for: the pod is gone, or it finished (a finished pod holds nothing)."""
    if not touched_nodes(pod):
        return False
    return event_type == "DELETED" or (pod.get("status") or {}).get("phase") in _FINISHED_PHASES


def node_record(node: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a Node the planner reads (what the nodes index keeps)."""
    meta = node.get("metadata") or {}
    return {
        "name": meta.get("name", ""),
        "labels": dict(meta.get("labels") or {}),
        "allocatable": dict((node.get("status") or {}).get("allocatable") or {}),
        "taints": list((node.get("spec") or {}).get("taints") or ()),
        "schedulable": schedulable(node),
        "notReadySince": not_ready_since(node),
    }


ViewKey = tuple[NodeLabelKeys, str, int | None]


@dataclass
class _View:
    """NodeInfos for one (label keys, GPU resource, preemption threshold)."""

    infos: dict[str, NodeInfo] = field(default_factory=dict)
    members: dict[GroupKey, dict[str, NodeInfo]] = field(default_factory=dict)
    """Each (GPU model, rack) group's nodes by name."""
    groups: dict[GroupKey, NodeGroup] = field(default_factory=dict)
    dirty: set[str] = field(default_factory=set)
    built: bool = False
    inventory: Inventory | None = None

    def put(self, name: str, info: NodeInfo | None) -> set[GroupKey]:
        """Replace (or drop) one node; the groups whose membership or room changed."""
        if self.infos.get(name) == info:
            return set()  # e.g. a pod's status changed, not its room
        touched: set[GroupKey] = set()
        old = self.infos.pop(name, None)
        if old is not None:
            key = (old.gpu_model, old.rack)
            self.members[key].pop(name, None)
            touched.add(key)
        if info is not None:
            key = (info.gpu_model, info.rack)
            self.infos[name] = info
            self.members.setdefault(key, {})[name] = info
            touched.add(key)
        return touched

    def regroup(self, keys: set[GroupKey]) -> None:
        """New :class:`NodeGroup` s for ``keys`` (their remembered room is dropped)."""
        for key in keys:
            nodes = self.members.get(key)
            if nodes:
                self.groups[key] = NodeGroup(nodes.values())
            else:
                self.members.pop(key, None)
                self.groups.pop(key, None)


class CapacityLedger:
    """Per-node free room, recomputed only for nodes that changed since the last ask.

    ``mark`` is called from watch handlers; reads come from reconcile rounds on other
    threads, hence the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._views: dict[ViewKey, _View] = {}
        self._reserved: dict[tuple[str, str], tuple[str, PodSlot]] = {}
        self.recomputed = 0
        """Nodes recomputed so far (what tests and the benchmark read)."""

    def mark(self, names: Iterable[str]) -> None:
        """Nodes whose room or labels changed: recompute them at the next ask."""
        with self._lock:
            for view in self._views.values():
                view.dirty.update(names)

    def reserve(self, pod: Mapping[str, Any]) -> None:
        """Count a pod the plan is about to create on its planned node, until its watch
        event arrives.

        The planner reserves under the placement lock, before the create is sent, so a
        plan made for another job a moment later already sees the room as taken.
        """
        key = _pod_key(pod)
        with self._lock:
            for node, slot in pod_slots(pod).items():
                self._reserved[key] = (node, slot)
                for view in self._views.values():
                    view.dirty.add(node)

    def release(self, pod: Mapping[str, Any]) -> None:
        """Drop a reservation: the pod was not created after all, or the pods index now
        counts it."""
        key = _pod_key(pod)
        with self._lock:
            held = self._reserved.pop(key, None)
            if held is not None:
                for view in self._views.values():
                    view.dirty.add(held[0])

    def inventory(self, nodes: Mapping[str, Iterable[Mapping[str, Any]]],
                  slots: Mapping[str, Iterable[PodSlot]], labels: NodeLabelKeys,
                  gpu_resource: str, preemptible_below: int | None = None) -> Inventory:
        """The schedulable nodes with their free room, as of the latest events.

        ``nodes`` maps a node's name to its :func:`node_record` (the nodes index) and
        ``slots`` a node's name to the :class:`PodSlot` s on it (the pods index).
        """
        key: ViewKey = (labels, gpu_resource, preemptible_below)
        with self._lock:
            view = self._views.setdefault(key, _View())
            names = set(view.dirty) if view.built else set(nodes)
            touched: set[GroupKey] = set()
            for name in names:
                record = next(iter(nodes.get(name, ())), None)
                info = (self._node_info(record, self._with_reserved(name, slots), key)
                        if record is not None and record["schedulable"] else None)
                touched |= view.put(name, info)
                self.recomputed += 1
            view.regroup(touched)
            if names or view.inventory is None:
                # Shallow copies: the groups are immutable, so rounds already holding the
                # previous inventory keep a consistent picture.
                view.inventory = Inventory(groups=dict(view.groups),
                                           by_name=dict(view.infos))
            view.dirty.clear()
            view.built = True
            return view.inventory

    def _with_reserved(self, name: str, slots: Mapping[str, Iterable[PodSlot]]
                       ) -> list[PodSlot]:
        indexed = list(slots.get(name, ()))
        return indexed + [slot for node, slot in self._reserved.values() if node == name]

    @staticmethod
    def _node_info(record: Mapping[str, Any], slots: Iterable[PodSlot],
                   key: ViewKey) -> NodeInfo:
        labels, gpu, below = key
        used = preemptible = Resources()
        for slot in slots:
            need = pod_requests(slot.spec, gpu)
            used = used + need
            if below is not None and slot.bound and slot.priority < below:
                preemptible = preemptible + need
        allocatable = dict(record["allocatable"])
        allocatable.setdefault("pods", DEFAULT_POD_SLOTS)
        node_labels = record["labels"]
        return NodeInfo(
            name=record["name"],
            rack=node_labels.get(labels.rack, ""),
            nvlink_domain=node_labels.get(labels.nvlink_domain, ""),
            gpu_model=node_labels.get(labels.gpu_model, ""),
            spine=node_labels.get(labels.spine, "") if labels.spine else "",
            free=from_resource_list(allocatable, gpu) - used,
            preemptible=preemptible,
            taints=tuple(Taint(t["key"], t.get("value") or "", t.get("effect") or "")
                         for t in record["taints"]),
            labels=tuple(sorted(node_labels.items())),
        )
