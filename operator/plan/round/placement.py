"""Steps that bring the pod count to the spec: gang withdrawal, resize, adding pods (with
the replacement backoff).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ringwright.objects import Obj

from ...api.conditions import parse_time
from ...api.models import TrainingJobStatus
from ...api.schedulingpolicy import SchedulingPolicySpec
from ..health.nodeloss import with_node_loss_tolerations
from ..health.stragglers import avoiding, inventory_without, still_avoided
from ..isolation import harden
from ..manifests import PS, WORKER, pod
from ..placement.resources import pod_requests
from ..pods import PodState, PodView
from ..types import Event
from .servers import servers
from .state import NOTHING, Outcome, Round, SetCondition, earliest, event, merged
from .status import StatusChange, WorldChange, world_changed


def backoff(failures: int, base: float, cap: float) -> float:
    """Delay before the next replacement after ``failures`` in a row (counted since the
    world last held every worker): base, 2·base, 4·base, … up to cap."""
    return float(min(cap, base * math.pow(2, max(failures - 1, 0))))


RECHECK_SECONDS = 5.0
"""How soon a round looks again at a pod the scheduler could not place while its planned
node still seemed to have room (the binding that took it may not be observed yet)."""


def gang_timeout(r: Round, policy: SchedulingPolicySpec) -> Outcome:
    """Pods still unbound ``gangTimeoutSeconds`` after creation are deleted, all of them,
    so the next round places the gang again from what is free then. So are they at once
    when the plan was overtaken: the scheduler found no node for one of them and its
    planned node is gone or full (another pod was bound there since the plan was made).

    Sets: the plan's delete and an event; stops the resize when it withdraws the gang."""
    limit = policy.gang_timeout_seconds
    unbound = [p for p in r.pods if p.state == PodState.PENDING
               and not p.node and p.created is not None]
    if not unbound:
        return NOTHING
    oldest = min(p.created or r.now for p in unbound)
    overtaken = _overtaken(r, policy, unbound)
    if overtaken:
        reason, message = "PlanOvertaken", (
            f"the scheduler found no node for {overtaken.name} and its planned node "
            f"{overtaken.planned_node} has no room left for it; {len(unbound)} unbound pods "
            "withdrawn, placing again")
    elif r.now - oldest >= limit:
        reason, message = "GangTimeout", (
            f"{len(unbound)} pods stayed unbound for {limit}s (spec.gangTimeoutSeconds of "
            "the SchedulingPolicy); withdrawn, placing again")
    else:
        wait = oldest + limit - r.now
        if any(p.unschedulable for p in unbound):
            wait = min(wait, RECHECK_SECONDS)
        return Outcome(requeue=wait)
    return Outcome(delete=tuple(p.name for p in unbound),
                   events=(event(reason, message, warning=True),), requeue=1.0, stop=True)


def _overtaken(r: Round, policy: SchedulingPolicySpec,
               unbound: Sequence[PodView]) -> PodView | None:
    """The first unbound pod the scheduler gave up on whose planned node cannot take it
    now, not even by preempting; None when there is none."""
    bodies: dict[str, Obj] | None = None
    for p in unbound:
        if not (p.unschedulable and p.planned_node):
            continue
        node = r.obs.inventory.node(p.planned_node)
        if node is None:  # deleted, cordoned or NotReady since the plan
            return p
        if bodies is None:
            bodies = {b["metadata"]["name"]: b for b in r.obs.pods}
        need = pod_requests(bodies[p.name].get("spec") or {}, policy.gpu_resource)
        if (node.free + node.preemptible).count_fitting(need) == 0:
            return p
    return None


def resize(r: Round, status: TrainingJobStatus, doomed: frozenset[str]) -> Outcome:
    """Bring the worker (and ps) count to the spec: remove highest ranks, add lowest free.

    ``doomed``: the pods earlier steps already delete. Sets: the plan's mark_leaving and
    delete (scale down, drained leavers; for ps pods what :func:`.servers.servers` sets),
    then what :func:`add_pods` sets."""
    wanted = r.spec.workers.replicas
    alive = [p for p in r.workers if p.alive and p.name not in doomed
             and p.leaving_since is None]
    ranks = {m.pod: m.rank for m in r.obs.world.members} if r.obs.world else {}
    leaving: list[str] = []
    deleted: list[str] = []
    told: tuple[Event, ...] = ()
    if len(alive) > wanted:
        # Pods outside the world hold no state: they go first, then the highest ranks;
        # before all, pods outside the topology domains Kueue now counts for the job.
        surplus = r.obs.topology_surplus
        order = sorted(alive, key=lambda p: (p.name in surplus, p.name in ranks,
                                             ranks.get(p.name, 0), p.index))
        for p in order[wanted - len(alive):]:
            (leaving if p.name in ranks else deleted).append(p.name)
        told = (event("ScalingDown", f"workers {len(alive)} -> {wanted}"),)
    drain = r.settings.drain_seconds
    requeue: float | None = None
    for p in r.workers:
        if p.leaving_since is None or p.state == PodState.DELETING:
            continue
        drained = p.state in (PodState.SUCCEEDED, PodState.FAILED)
        if drained or r.now - p.leaving_since >= drain:
            deleted.append(p.name)
        else:
            requeue = earliest(requeue, drain - (r.now - p.leaving_since))
    scaled = merged(Outcome(mark_leaving=tuple(leaving), delete=tuple(deleted), events=told,
                            requeue=requeue), servers(r, doomed))
    missing_workers = wanted - len(alive)
    # Only a PS pod below spec.ps.replicas serves: one past it is leaving (a shrink).
    ps_wanted = r.spec.ps.replicas if r.spec.ps else 0
    ps_alive = [p for p in r.ps if p.alive and p.name not in doomed and p.index < ps_wanted]
    missing_ps = ps_wanted - len(ps_alive)
    if missing_workers <= 0 and missing_ps <= 0:
        return scaled
    return merged(scaled, add_pods(r, status, alive + ps_alive, missing_workers))


def add_pods(r: Round, status: TrainingJobStatus, live: Sequence[PodView],
             missing_workers: int) -> Outcome:
    """Place what is missing and create it, once the policy is usable, a refused create's
    hold is over and the replacement backoff has passed.

    Sets: condition Schedulable, status.world.gpuModel; the plan's create."""
    policy = r.obs.policy
    if policy is None:
        return Outcome(requeue=r.settings.resync_seconds)  # placed once the policy is fixed
    hold = r.obs.hold_creates_until
    if hold is not None and r.now < hold:
        return Outcome(requeue=hold - r.now)  # a refused create waits out its backoff
    last_failure = parse_time(status.last_failure_time)
    if last_failure is not None:
        ready_at = last_failure + backoff(status.failures_since_whole,
                                          r.settings.backoff_base_seconds,
                                          r.settings.backoff_cap_seconds)
        if r.now < ready_at:
            return Outcome(requeue=ready_at - r.now)
    # Nodes stragglers ran on stay out of the plan and out of the scheduler's reach.
    avoided = [a.node for a in still_avoided(status.avoided_nodes, r.now)]
    placed = r.placer(r.spec, policy, inventory_without(r.obs.inventory, avoided), live)
    if placed.reason:
        # Gang rule and policy limits: nothing is created until all of it fits.
        return Outcome(
            conditions=(SetCondition("Schedulable", False, placed.reason, placed.message),),
            events=() if r.workers else (event(placed.reason, placed.message, warning=True),),
            requeue=r.settings.resync_seconds)
    if len(placed.workers) < missing_workers:
        schedulable = SetCondition(
            "Schedulable", False, "InsufficientCapacity",
            f"placed {len(placed.workers)} of {missing_workers} missing workers; the rest "
            "are added when room frees up")
        requeue: float | None = r.settings.resync_seconds
    else:
        schedulable, requeue = SetCondition("Schedulable", True, "Placed", placed.summary), None
    # A pod on its way out leaves its index free: its replacement keeps the name (the
    # create is refused as AlreadyExists until the old pod is gone, then it goes through).
    created: list[Obj] = []
    ps_indices = r.spec.ps.replicas if r.spec.ps else 0
    for role, fragments, taken in (
        (WORKER, placed.workers, {p.index for p in r.workers if p.state != PodState.DELETING}),
        (PS, placed.ps, {p.index for p in r.ps if p.state != PodState.DELETING}),
    ):
        # A PS pod's index is its server's, and only those below spec.ps.replicas serve:
        # a free one held by a pod still leaving waits for it.
        bound = len(taken) + len(fragments) + 1 if role == WORKER else ps_indices
        free = (i for i in range(bound) if i not in taken)
        for fragment, index in zip(fragments, free, strict=False):
            created.append(harden(r.job, pod(r.job, role, index, avoiding(
                with_node_loss_tolerations(fragment, r.job["spec"], role == WORKER,
                                           policy.node_loss.toleration_seconds),
                avoided if role == WORKER else ()))))
    change = StatusChange()
    if placed.gpu_model:
        change["world"] = world_changed(status.world, WorldChange(gpu_model=placed.gpu_model))
    return Outcome(status=change, conditions=(schedulable,), create=tuple(created),
                   requeue=requeue)
