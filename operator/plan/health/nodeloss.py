"""Members lost to their node or their readiness, and containers that keep restarting.

Kubernetes evicts the pods of a NotReady node only after their not-ready/unreachable
tolerations run out (300 s by default); a training job cannot wait that long, so its
pods tolerate a short, policy-set time, and the planner itself declares a member lost
once its node has been NotReady, or its pod Unready, for the policy's threshold. A
member that has not been Ready since its container started may still be starting (pulling
data, building its model): its threshold counts from the container's start plus its
role's startup grace, so a slow start is not a loss; one that was Ready in this container
and turned Unready is hung, and counts from that turn. A
container that the kubelet restarts in place is a failure too: each restart counts
toward ``backoffLimit``, once.

Pure functions of pod views, node readiness and ``now``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ringwright.objects import Obj

from ..pods import PodState, PodView

NOT_READY_TAINT = "node.kubernetes.io/not-ready"
UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"
CRASH_LOOP = "CrashLoopBackOff"


def node_loss_tolerations(template: Sequence[Obj], seconds: int) -> list[Obj]:
    """The template's tolerations, with the NoExecute ones for a NotReady or unreachable
    node replaced by ours: tolerate ``seconds``, then Kubernetes evicts the pod."""
    ours = {NOT_READY_TAINT, UNREACHABLE_TAINT}
    kept = [t for t in template if not (t.get("key") in ours
                                        and t.get("effect") in ("NoExecute", None, ""))]
    return [*kept, *({"key": key, "operator": "Exists", "effect": "NoExecute",
                      "tolerationSeconds": seconds} for key in sorted(ours))]


def with_node_loss_tolerations(fragment: Obj, job_spec: Obj, worker: bool,
                               seconds: int) -> Obj:
    """A placement fragment that also sets the pod's tolerations: its template's, with
    :func:`node_loss_tolerations` for ``seconds``."""
    template = ((job_spec.get("workers" if worker else "ps") or {}).get("template") or {})
    tolerations = (template.get("spec") or {}).get("tolerations") or []
    return {**fragment, "tolerations": node_loss_tolerations(tolerations, seconds)}


@dataclass(frozen=True)
class Loss:
    """A member declared lost, and why (for the event)."""

    pod: PodView
    reason: str
    message: str


def unready_clock(p: PodView, grace: float) -> tuple[float, float | None] | None:
    """When an Unready pod's unready threshold starts to count, with its container's
    start when that is the end of its startup grace (it has not been Ready since the
    container started); None when it does not count (the container has not run yet, or
    nothing is known).

    Never before the container started: a kubelet restart gives a new container the grace
    again (its restarts count toward backoffLimit on their own)."""
    if p.starting:
        return None
    if p.started is not None and (p.unready_since is None or p.unready_since <= p.started):
        return p.started + grace, p.started
    return (p.unready_since, None) if p.unready_since is not None else None


def lost_members(pods: Sequence[PodView], node_down_since: Mapping[str, float],
                 limit: float, now: float, startup_grace: Mapping[str, float]
                 ) -> tuple[list[Loss], float | None]:
    """Pods lost to their node being NotReady, or to running Unready (an Unready pod
    leaves the world at once, but keeps its index until replaced), for at least
    ``limit`` seconds; and when the next loss would be due (to look again then).

    ``startup_grace`` holds each role's grace (seconds) for a container that has not been
    Ready since it started (see :func:`unready_clock`); a role not in it has none."""
    lost: list[Loss] = []
    next_at: float | None = None

    def due(since: float) -> bool:
        nonlocal next_at
        if now - since >= limit:
            return True
        next_at = min(next_at, since + limit) if next_at is not None else since + limit
        return False

    for p in pods:
        if not p.alive:
            continue
        down = node_down_since.get(p.node) if p.node else None
        if down is not None and due(down):
            lost.append(Loss(p, "NodeNotReady",
                             f"{p.name}: node {p.node} NotReady for {now - down:.0f}s"))
        elif p.state == PodState.UNREADY:
            clock = unready_clock(p, startup_grace.get(p.role, 0.0))
            if clock is None or not due(clock[0]):
                continue
            since, started = clock
            if started is not None:
                lost.append(Loss(p, "MemberNeverReady",
                                 f"{p.name}: not Ready {now - started:.0f}s after its "
                                 f"container started (startup grace {since - started:.0f}s)"))
            else:
                lost.append(Loss(p, "MemberUnready", f"{p.name}: not Ready for "
                                 f"{now - since:.0f}s"))
    return lost, next_at


def new_container_restarts(pods: Sequence[PodView], counted: Mapping[str, int]
                           ) -> tuple[dict[str, int], dict[str, int]]:
    """Container restarts not yet counted, and the new record of counted restarts.

    Both are keyed by ``name/uid`` (a replacement pod starts from zero); the record keeps
    only pods that still exist.
    """
    fresh: dict[str, int] = {}
    record: dict[str, int] = {}
    for p in pods:
        key = f"{p.name}/{p.uid}"
        if p.restarts > 0:
            record[key] = p.restarts
        if p.restarts > counted.get(key, 0):
            fresh[key] = p.restarts - counted.get(key, 0)
    return fresh, record


def crash_looping(pods: Sequence[PodView]) -> list[str]:
    """Names of pods with a container waiting in CrashLoopBackOff."""
    return sorted(p.name for p in pods if p.waiting == CRASH_LOOP)
