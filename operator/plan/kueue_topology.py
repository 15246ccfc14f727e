"""What Kueue's topology-aware scheduling (TAS) assigns a pod set, and how the job's
running pods fit it. Pure: objects in, decisions out.

A ``topologyAssignment`` is a list of domains (a value per topology level, e.g. a rack and
a host) with a number of pods each. The operator narrows the pods it creates to the
domains that still have room and, when the job shrinks, lets the pods Kueue no longer
counts go first, so the pods always stand where Kueue counted them: one placement.

Growing through workload slices keeps that placement only where Kueue v0.17 keeps it:
with its ``ElasticJobsViaWorkloadSlicesWithTAS`` gate, a replacing slice of a pod set
whose request is *unconstrained* (or implied by a TAS-only ClusterQueue) keeps the
replaced slice's domains and places only the new pods; a smaller one keeps the first
domains of the list. Under that gate Kueue drops required and preferred requests
(``pkg/scheduler/flavorassigner/tas_flavorassigner.go`` marks them unsupported, and the
pod set is admitted on quota alone, with no topology assignment), so those jobs keep the
size they were admitted with and say so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ringwright.objects import Obj

REQUIRED, PREFERRED, UNCONSTRAINED, IMPLIED = "required", "preferred", "unconstrained", "implied"
REQUEST_ANNOTATIONS = {
    "kueue.x-k8s.io/podset-required-topology": REQUIRED,
    "kueue.x-k8s.io/podset-preferred-topology": PREFERRED,
    "kueue.x-k8s.io/podset-unconstrained-topology": UNCONSTRAINED,
}
"""Kueue's own annotations of a pod template asking for TAS, and the field of the pod
set's ``topologyRequest`` each sets (a level, a node label key; or ``"true"``)."""
SLICEABLE = frozenset({UNCONSTRAINED, IMPLIED})
"""Requests whose domains Kueue v0.17 carries over to a replacing slice (with its
``ElasticJobsViaWorkloadSlicesWithTAS`` gate)."""
HOSTNAME = "kubernetes.io/hostname"

Domain = tuple[tuple[str, ...], int]
"""A domain's value at each level (highest first) and the pods Kueue counted there."""


def topology_request(template: Mapping[str, Any]) -> Obj | None:
    """The pod set's ``topologyRequest`` from Kueue's annotations on a pod ``template``."""
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    asked: Obj = {}
    for key, field in REQUEST_ANNOTATIONS.items():
        value = annotations.get(key)
        if not value:
            continue
        # Kueue reads the unconstrained annotation as a bool (strconv.ParseBool).
        asked[field] = str(value).lower() in ("1", "t", "true") \
            if field == UNCONSTRAINED else str(value)
    return asked or None


def request_kind(pod_set: Obj) -> str:
    """Which kind of topology request a Workload pod set makes: required, preferred,
    unconstrained, or implied (none: a TAS-only ClusterQueue assigns a topology anyway)."""
    request = pod_set.get("topologyRequest") or {}
    for kind in (REQUIRED, PREFERRED, UNCONSTRAINED):
        if request.get(kind) is not None:
            return kind
    return IMPLIED


@dataclass(frozen=True)
class Assigned:
    """A pod set's topology assignment, expanded from Kueue's compact form."""

    levels: tuple[str, ...]
    """Node label keys, highest level first."""
    domains: tuple[Domain, ...]
    """In Kueue's order (a smaller replacing slice keeps the first ones)."""

    def values(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """(node label, sorted values assigned) for each level."""
        return tuple((level, tuple(sorted({values[at] for values, _ in self.domains})))
                     for at, level in enumerate(self.levels))


def read_assignment(assignment: Obj) -> Assigned:
    """Expand a ``topologyAssignment`` (slices of domains whose value at a level is one
    ``universal`` value or ``prefix + root + suffix`` per domain, with a ``universal``
    or ``individual`` pod count)."""
    levels = tuple(str(level) for level in assignment.get("levels") or ())
    domains: list[Domain] = []
    for piece in assignment.get("slices") or ():
        size = int(piece.get("domainCount", 0))
        columns: list[list[str]] = []
        for level in piece.get("valuesPerLevel") or ():
            if level.get("universal") is not None:
                columns.append([str(level["universal"])] * size)
            else:
                each = level.get("individual") or {}
                columns.append([f"{each.get('prefix') or ''}{root}{each.get('suffix') or ''}"
                                for root in each.get("roots") or ()])
        counts = piece.get("podCounts") or {}
        pods = ([int(counts["universal"])] * size if counts.get("universal") is not None
                else [int(c) for c in counts.get("individual") or ()])
        for at in range(size):
            domains.append((tuple(column[at] for column in columns), pods[at]))
    return Assigned(levels, tuple(domains))


@dataclass(frozen=True)
class Fit:
    """How a job's running pods stand in an assignment."""

    room: tuple[tuple[str, tuple[str, ...]], ...]
    """(node label, values) per level of the domains that can take a new pod (all
    domains when none has room: nothing is missing then)."""
    surplus: frozenset[str]
    """Pods outside every domain, or beyond their domain's count: the first to leave."""
    host_room: tuple[tuple[str, int], ...] = ()
    """When the lowest level is the host: (host, pods Kueue counted there that are still
    missing) for every host assigned. The affinity of :attr:`room` lets a pod onto any
    host with room, so without these the planner could put two new pods where Kueue
    counted one."""


def fit(assigned: Assigned, pods: Sequence[tuple[str, Mapping[str, str]]]) -> Fit:
    """Match ``pods`` (name and its node's labels, in the order they should stay: the
    last of a full domain is its surplus) against the domains Kueue counted."""
    left = {values: count for values, count in assigned.domains}
    surplus: set[str] = set()
    for name, labels in pods:
        values = tuple(labels.get(level, "") for level in assigned.levels)
        if left.get(values, 0) > 0:
            left[values] -= 1
        else:
            surplus.add(name)
    open_ = [(values, 1) for values, count in assigned.domains if left[values] > 0]
    room = Assigned(assigned.levels, tuple(open_) or assigned.domains).values()
    hosts = tuple((values[-1], left[values]) for values, _ in assigned.domains) \
        if assigned.levels[-1:] == (HOSTNAME,) else ()
    return Fit(room, frozenset(surplus), hosts)


def node_labels(node: str, labels: Mapping[str, str] | None) -> Mapping[str, str]:
    """The labels a pod's node is matched by: the node's own, or only its name as the
    hostname level when the node is not in the inventory (cordoned, gone)."""
    return labels if labels is not None else {HOSTNAME: node}
