"""Reading pods: which role and index they hold and what state they are in."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from ringwright.objects import Obj

from ..api.conditions import parse_time
from .manifests import INDEX_LABEL, LEAVING_ANNOTATION, PLANNED_NODE_ANNOTATION, ROLE_LABEL


class PodState(StrEnum):
    """What the planner needs to know about one pod."""

    PENDING = "Pending"
    """Created, not yet running and ready."""
    READY = "Ready"
    """Running, Ready and addressable: may be a world member."""
    UNREADY = "Unready"
    """Running but its readiness probe fails (stalled, or still starting)."""
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    DELETING = "Deleting"


@dataclass(frozen=True)
class PodView:
    """The facts about one pod the planner uses, read once from its body."""

    name: str
    uid: str
    role: str
    index: int
    state: PodState
    ip: str
    node: str
    leaving_since: float | None
    restarts: int
    created: float | None = None
    """``metadata.creationTimestamp`` as epoch seconds."""
    unready_since: float | None = None
    """For an Unready pod: when its Ready condition last changed."""
    started: float | None = None
    """When the training container (the template's first) last started running, as epoch
    seconds (a kubelet restart of the container moves it); None while it does not run."""
    starting: bool = False
    """The training container has not run yet (its image is pulling, or it waits for other
    containers) although the pod is Running."""
    waiting: str = ""
    """Why a container waits (e.g. ``CrashLoopBackOff``); empty when none does."""
    planned_node: str = ""
    """The node the plan chose for it (its planned-node annotation); empty if none."""
    unschedulable: bool = False
    """The scheduler found no node for it and nominated none to free by preemption."""

    @property
    def alive(self) -> bool:
        """Counts towards the role's replicas (not finished, not going away)."""
        return self.state in (PodState.PENDING, PodState.READY, PodState.UNREADY)


def _ready(status: Obj) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in status.get("conditions") or [])


def _ready_changed(status: Obj) -> float | None:
    return next((parse_time(c.get("lastTransitionTime")) for c in status.get("conditions") or []
                 if c.get("type") == "Ready"), None)


def _unschedulable(status: Obj) -> bool:
    # A pod waiting for a preemption it started has a nominated node: it will fit there.
    return not status.get("nominatedNodeName") and any(
        c.get("type") == "PodScheduled" and c.get("status") == "False"
        and c.get("reason") == "Unschedulable" for c in status.get("conditions") or [])


def _waiting(status: Obj) -> str:
    for c in status.get("containerStatuses") or []:
        reason = ((c.get("state") or {}).get("waiting") or {}).get("reason")
        if reason:
            return str(reason)
    return ""


def _training_container(pod: Obj) -> Obj:
    """The status of the pod's first container (the one the runtime runs in), or {}."""
    containers = (pod.get("spec") or {}).get("containers") or [{}]
    name = containers[0].get("name")
    return next((c for c in (pod.get("status") or {}).get("containerStatuses") or []
                 if c.get("name") == name), {})


_VIEWS: dict[tuple[str, str], PodView | None] = {}
"""Views by (uid, resourceVersion): a stored pod does not change without a new version,
and every round views every pod of its job, most of them unchanged since the last."""
_VIEWS_KEPT = 1 << 16


def view(pod: Obj) -> PodView | None:
    """A :class:`PodView`, or None for a pod without ringwright's role/index labels."""
    meta = pod.get("metadata") or {}
    key = (str(meta.get("uid") or ""), str(meta.get("resourceVersion") or ""))
    if not all(key):  # not a stored object (a manifest, a test's pod)
        return _view(pod)
    try:
        return _VIEWS[key]
    except KeyError:
        pass
    found = _view(pod)
    if len(_VIEWS) >= _VIEWS_KEPT:
        _VIEWS.clear()  # older versions are never asked for again
    _VIEWS[key] = found
    return found


def _view(pod: Obj) -> PodView | None:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    try:
        index = int(labels[INDEX_LABEL])
        role = labels[ROLE_LABEL]
    except (KeyError, ValueError):
        return None
    status = pod.get("status") or {}
    phase = status.get("phase", "Pending")
    if meta.get("deletionTimestamp"):
        state = PodState.DELETING
    elif phase == "Succeeded":
        state = PodState.SUCCEEDED
    elif phase == "Failed":
        state = PodState.FAILED
    elif phase == "Running" and status.get("podIP"):
        state = PodState.READY if _ready(status) else PodState.UNREADY
    else:
        state = PodState.PENDING
    annotations = meta.get("annotations") or {}
    leaving = annotations.get(LEAVING_ANNOTATION)
    training = _training_container(pod)
    state_ = training.get("state") or {}
    restarts = sum(int(c.get("restartCount", 0)) for c in status.get("containerStatuses") or [])
    return PodView(
        name=meta["name"],
        uid=meta.get("uid", ""),
        role=role,
        index=index,
        state=state,
        ip=status.get("podIP", ""),
        node=(pod.get("spec") or {}).get("nodeName", ""),
        leaving_since=float(leaving) if leaving else None,
        restarts=restarts,
        created=parse_time(meta.get("creationTimestamp")),
        unready_since=_ready_changed(status) if state == PodState.UNREADY else None,
        waiting=_waiting(status),
        started=parse_time((state_.get("running") or {}).get("startedAt")),
        starting=bool(state_.get("waiting")) and not training.get("restartCount")
        and not (training.get("lastState") or {}).get("terminated"),
        planned_node=annotations.get(PLANNED_NODE_ANNOTATION, ""),
        unschedulable=state == PodState.PENDING and _unschedulable(status),
    )
