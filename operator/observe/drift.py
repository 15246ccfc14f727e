"""Scaffold drift: which of a job's scaffold objects differ from what the watch cache holds.

The scaffold (ServiceAccount, Role, RoleBinding, Service, reports ConfigMap, and whatever
:func:`ringwright.operator.plan.manifests.scaffold` adds later) is watched like everything else,
so each round compares the desired objects with the cached ones and applies only those
that drifted: no request at all while nothing changed. The comparison knows no kind: an
object drifted when it is missing or when some field we set has another value there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ringwright.objects import Obj


@dataclass(frozen=True)
class Watched:
    """Where objects of one scaffold kind are watched."""

    group: str
    version: str
    plural: str
    shared_index: str = ""
    """An index the operator keeps anyway for this kind, holding :func:`record` s."""

    @property
    def index(self) -> str:
        """Name of the kopf index that holds the operator's objects of this kind."""
        return self.shared_index or f"scaffold_{self.plural}"


SCAFFOLD_KINDS: dict[str, Watched] = {
    "ServiceAccount": Watched("", "v1", "serviceaccounts"),
    "Role": Watched("rbac.authorization.k8s.io", "v1", "roles"),
    "RoleBinding": Watched("rbac.authorization.k8s.io", "v1", "rolebindings"),
    "Service": Watched("", "v1", "services"),
    "NetworkPolicy": Watched("networking.k8s.io", "v1", "networkpolicies"),
    # The world and reports maps are indexed for the rounds already (cache.JOB_CONFIGMAPS):
    # one copy of their data is enough.
    "ConfigMap": Watched("", "v1", "configmaps", shared_index="job_configmaps"),
}
"""Every kind the scaffold holds; a kind missing here is refused by :func:`watched`."""

_KEPT_META = ("name", "namespace", "labels", "annotations", "ownerReferences",
              "resourceVersion")


def watched(kind: str) -> Watched:
    """The watch of ``kind``; a scaffold kind nobody watches is a programming error."""
    try:
        return SCAFFOLD_KINDS[kind]
    except KeyError:
        raise KeyError(f"scaffold kind {kind} is not watched: add it to SCAFFOLD_KINDS "
                       "(and the operator's RBAC)") from None


def record(body: Mapping[str, Any]) -> Obj:
    """What the index keeps of a scaffold object: everything but status and the
    bookkeeping metadata (managedFields, uid, timestamps)."""
    meta = body.get("metadata") or {}
    kept: Obj = {k: v for k, v in body.items() if k not in ("metadata", "status")}
    kept["metadata"] = {k: meta[k] for k in _KEPT_META if k in meta}
    return kept


def covers(seen: Any, desired: Any) -> bool:
    """Whether ``seen`` holds every field of ``desired`` with the same value.

    Maps may hold more keys (defaults the API server filled in, fields of other
    managers); lists must match element by element (an extra rule in a Role is drift).
    """
    if isinstance(desired, Mapping):
        # An empty value is what the API server leaves out: absent covers it.
        return isinstance(seen, Mapping) and all(
            covers(seen[k], v) if k in seen else v in ({}, [], None)
            for k, v in desired.items())
    if isinstance(desired, list):
        return (isinstance(seen, list) and len(seen) == len(desired)
                and all(covers(s, d) for s, d in zip(seen, desired, strict=True)))
    return bool(seen == desired)


def drifted(desired: Obj, seen: Obj | None) -> bool:
    """Whether ``desired`` must be applied: missing, or a field of ours differs."""
    if seen is None:
        return True
    ours = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind")}
    return not covers(seen, ours)
