"""What the operator knows of the cluster, held in memory by its watches.

kopf indices (see :mod:`ringwright.operator.handlers`) keep every object the planner
reads; this module names them and answers the observe step's questions from them, so
a reconcile round makes no API call to look. Our own latest writes (a job's status,
its world) are overlaid until the watch catches up, so a round that follows a write at
once never plans from the state before it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ringwright.objects import Obj

from ..api.schedulingpolicy import NodeLabelKeys
from ..plan.placement.inventory import Inventory
from .drift import SCAFFOLD_KINDS, watched
from .ledger import CapacityLedger, PodSlot

# Names of the kopf indices: the handler functions are called so, and kopf passes each
# index to handlers as the keyword argument of that name.
PODS_BY_JOB = "pods_by_job"
POD_SLOTS = "pod_slots"
NODES = "nodes_by_name"
"""Not a kopf index: the operator's own informer's records (``observe/nodes.py``)."""
JOB_CONFIGMAPS = "job_configmaps"
POLICIES = "scheduling_policies"
PRIORITIES = "priority_classes"
WORKLOADS = "workloads_by_job"
FLAVORS = "resource_flavors"
WORKLOAD_PRIORITIES = "workload_priority_classes"
KUEUE_INDICES = (WORKLOADS, FLAVORS, WORKLOAD_PRIORITIES)
"""Kept only when the Kueue integration is on (its CRDs exist then)."""
INDICES = tuple(dict.fromkeys((PODS_BY_JOB, POD_SLOTS, JOB_CONFIGMAPS, POLICIES,
                               PRIORITIES, *sorted(w.index for w in SCAFFOLD_KINDS.values()))))

Index = Mapping[Any, Iterable[Any]]
"""A kopf index as the cache reads it: key -> the values of every object under it."""


def snapshot(values: Iterable[Any]) -> list[Any]:
    """The values of one key of a kopf index, as one consistent list.

    The event loop updates the index while rounds read it from their threads, and no
    read of a kopf store is atomic (``list()`` asks the store's ``__len__``, Python code,
    after taking the iterator of its dict): an update in between fails the read with
    "dictionary changed size during iteration". Such a read is taken again; an
    update is rare next to a read, so this ends at once.
    """
    while True:
        try:
            return list(values)
        except RuntimeError as err:
            if "changed size" not in str(err):
                raise


class Cache(Protocol):
    """The observe step's questions; answered from memory."""

    def job_pods(self, namespace: str, job: str) -> list[Obj]:
        """Every pod labelled for ``job``."""
        ...

    def configmap(self, namespace: str, name: str) -> Obj | None:
        """A job's ConfigMap (world, reports), or None."""
        ...

    def policy(self, name: str) -> Obj | None:
        """The SchedulingPolicy's spec, or None when it does not exist."""
        ...

    def node_down_since(self, name: str) -> float | None:
        """Since when node ``name`` is NotReady; None while Ready or unknown to us."""
        ...

    def priority_value(self, name: str) -> int | None:
        """The value of PriorityClass ``name``; None when it does not exist."""
        ...

    def inventory(self, labels: NodeLabelKeys, gpu_resource: str,
                  preemptible_below: int | None) -> Inventory:
        """Schedulable nodes with their free room."""
        ...

    def scaffold_object(self, kind: str, namespace: str, name: str) -> Obj | None:
        """A job's scaffold object of ``kind`` as last seen (or written), or None."""
        ...


def _version(obj: Obj | None) -> int:
    try:
        return int(((obj or {}).get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:
        return 0


def newer(a: Obj | None, b: Obj | None) -> Obj | None:
    """Whichever of two copies of one object has the higher resourceVersion."""
    if a is None or b is None:
        return a if b is None else b
    return b if _version(b) > _version(a) else a


@dataclass
class Written:
    """Our latest writes, by (kind, namespace, name): read-your-writes for the next round."""

    objects: dict[tuple[str, str, str], Obj] = field(default_factory=dict)
    sent: dict[tuple[str, str, str], Obj] = field(default_factory=dict)
    """What we applied to get each answer in ``objects``, where it was an apply."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, kind: str, obj: Obj, sent: Obj | None = None) -> None:
        """Remember ``obj`` as written (the server's answer, with its resourceVersion),
        and ``sent``, the object we applied to get it."""
        meta = obj.get("metadata") or {}
        with self.lock:
            key = (kind, str(meta.get("namespace", "")), str(meta.get("name", "")))
            kept = newer(self.objects.get(key), obj) or obj
            self.objects[key] = kept
            if kept is obj and sent is not None:
                self.sent[key] = sent

    def answered(self, kind: str, seen: Obj, desired: Obj) -> bool:
        """Whether ``seen`` is the server's answer to our apply of ``desired`` itself:
        applying it again would change nothing, whatever the object looks like."""
        meta = seen.get("metadata") or {}
        key = (kind, str(meta.get("namespace", "")), str(meta.get("name", "")))
        with self.lock:
            ours = self.objects.get(key)
            return (ours is not None and self.sent.get(key) == desired
                    and _version(ours) == _version(seen))

    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        """Our last write of that object, if any."""
        with self.lock:
            return self.objects.get((kind, namespace, name))

    def outdated_by(self, kind: str, obj: Obj, deleted: bool) -> bool:
        """Whether a watched ``obj`` is newer than our write of it (someone else wrote
        or deleted it). A deletion also drops our copy, so it cannot stand in for an
        object that is gone; a write of ours newer than the deletion (the object was
        created again) stays."""
        meta = obj.get("metadata") or {}
        key = (kind, str(meta.get("namespace", "")), str(meta.get("name", "")))
        with self.lock:
            ours = self.objects.get(key)
            if ours is None:
                return True
            if _version(obj) <= _version(ours):
                return False  # the echo of our own write, or older
            if deleted:
                del self.objects[key]
                self.sent.pop(key, None)
            return True

    def forget_job(self, namespace: str, name: str) -> None:
        """Drop everything written for a job that is gone."""
        with self.lock:
            for key in [k for k in self.objects if k[1] == namespace
                        and (k[2] == name or k[2].startswith(f"{name}-"))]:
                del self.objects[key]
                self.sent.pop(key, None)


class IndexCache:
    """:class:`Cache` over kopf's indices, the capacity ledger and our own writes."""

    def __init__(self, indices: Mapping[str, Index], ledger: CapacityLedger,
                 written: Written) -> None:
        self._ix, self._ledger, self._written = indices, ledger, written

    def _one(self, index: str, key: Any) -> Any:
        values = snapshot(self._ix[index].get(key, ()))
        return values[0] if values else None

    def _all(self, index: str, key: Any) -> list[Obj]:
        """Shallow copies of every object under ``key`` of ``index``."""
        return [dict(v) for v in snapshot(self._ix[index].get(key, ()))]

    def job_pods(self, namespace: str, job: str) -> list[Obj]:
        """Every pod labelled for ``job`` (the pods-by-job index)."""
        return self._all(PODS_BY_JOB, (namespace, job))

    def configmap(self, namespace: str, name: str) -> Obj | None:
        """The indexed ConfigMap or our newer write of it."""
        seen: Obj | None = self._one(JOB_CONFIGMAPS, (namespace, name))
        return newer(seen, self._written.get("ConfigMap", namespace, name))

    def node_down_since(self, name: str) -> float | None:
        """From the nodes index."""
        record: Obj | None = self._one(NODES, name)
        since = (record or {}).get("notReadySince")
        return float(since) if since is not None else None

    def policy(self, name: str) -> Obj | None:
        """The SchedulingPolicy's spec."""
        spec: Obj | None = self._one(POLICIES, name)
        return spec

    def priority_value(self, name: str) -> int | None:
        """The PriorityClass's value."""
        value: int | None = self._one(PRIORITIES, name)
        return value

    def inventory(self, labels: NodeLabelKeys, gpu_resource: str,
                  preemptible_below: int | None) -> Inventory:
        """From the ledger, recomputing only nodes that changed."""
        slots: Mapping[str, Iterable[PodSlot]] = self._ix[POD_SLOTS]
        return self._ledger.inventory(self._ix[NODES], slots, labels, gpu_resource,
                                      preemptible_below)

    def scaffold_object(self, kind: str, namespace: str, name: str) -> Obj | None:
        """The indexed object or our newer write of it."""
        seen: Obj | None = self._one(watched(kind).index, (namespace, name))
        return newer(seen, self._written.get(kind, namespace, name))

    def workloads(self, namespace: str, job: str) -> list[Obj]:
        """The Kueue Workloads labelled for ``job`` (none when Kueue is not watched)."""
        if WORKLOADS not in self._ix:
            return []
        return self._all(WORKLOADS, (namespace, job))

    def flavor_labels(self, name: str) -> dict[str, str]:
        """The node labels of ResourceFlavor ``name``."""
        if FLAVORS not in self._ix:
            return {}
        labels: dict[str, str] | None = self._one(FLAVORS, name)
        return dict(labels or {})

    def workload_priority(self, name: str) -> int | None:
        """The value of WorkloadPriorityClass ``name`` (None when there is none)."""
        if WORKLOAD_PRIORITIES not in self._ix:
            return None
        value: int | None = self._one(WORKLOAD_PRIORITIES, name)
        return value
