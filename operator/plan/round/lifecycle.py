"""Steps that move the job through its lifecycle: left-behind pods, clean-up of a
finished job, suspend and resume, the deadline, completion, below the minimum.
"""

from __future__ import annotations

from ringwright.world import World

from ...api.conditions import parse_time, rfc3339
from ...api.models import CleanPodPolicy, ConditionStatus, JobPhase, TrainingJobStatus
from ..health.completion import completion
from ..pods import PodState
from ..types import Event
from .state import NOTHING, Move, Outcome, Round, SetCondition, event, generation_after
from .status import StatusChange, WorldChange, find_condition, world_changed


def empty_world(current: World, generation: int) -> World:
    """``current`` at ``generation`` with no members: everyone leaves (suspend)."""
    return current.model_copy(update={"generation": generation, "members": (), "ps": (),
                                      "store": current.store.model_copy(update={"address": ""})})


def left_behind(r: Round) -> Outcome:
    """Pods an earlier job of the same name left: they hold the names this job's pods
    need; never members, never counted.

    Sets: the plan's delete_left_behind (by UID)."""
    return Outcome(delete_left_behind=tuple(
        (p["metadata"]["name"], p["metadata"]["uid"]) for p in r.obs.left_behind
        if not p["metadata"].get("deletionTimestamp")))


def clean_up(r: Round, status: TrainingJobStatus) -> Outcome:
    """A finished job's pods go as cleanPodPolicy says; the job itself after its TTL.

    Under cleanPodPolicy Running, the members of a succeeded ring still running when rank
    0 exited end on their own: they finish the same last step and exit 0 within moments,
    and deleting them then would cut off their last logs and metrics. They are deleted
    only if still running ``rank_exit_grace_seconds`` after completion.

    Sets: the plan's delete, delete_job; a requeue for the grace or the TTL."""
    policy = r.spec.run_policy.clean_pod_policy
    done = parse_time(status.completion_time) or r.now
    ending = (
        {m.pod for m in r.obs.world.members}
        if status.phase == JobPhase.SUCCEEDED and policy == CleanPodPolicy.RUNNING
        and r.obs.world is not None and r.now < done + r.settings.rank_exit_grace_seconds
        else set())
    doomed = tuple(
        p.name for p in r.pods if p.state != PodState.DELETING and p.name not in ending and (
            policy == CleanPodPolicy.ALL or (policy == CleanPodPolicy.RUNNING and p.alive)))
    waits = [done + r.settings.rank_exit_grace_seconds - r.now] if any(
        p.alive for p in r.pods if p.name in ending) else []
    ttl = r.spec.run_policy.ttl_seconds_after_finished
    if ttl is not None and r.now >= done + ttl:
        return Outcome(delete=doomed, delete_job=True)
    if ttl is not None:
        waits.append(done + ttl - r.now)
    return Outcome(delete=doomed, requeue=min(waits) if waits else None)


def suspension(r: Round, status: TrainingJobStatus) -> Outcome:
    """Members learn from an empty world that they are out, then their pods get their own
    grace period (SIGTERM: the final checkpoint is written). Nothing here is a failure: no
    member is lost, restarts and backoffLimit are untouched.

    Sets: status.world, candidate, belowMinSince; phase Suspended, condition Suspended;
    the plan's world and delete_gracefully."""
    change = StatusChange(candidate=None, below_min_since=None)
    emptied: World | None = None
    told: tuple[Event, ...] = ()
    current = r.obs.world
    if current is not None and (current.members or current.ps):
        generation = generation_after(r, status)
        emptied = empty_world(current, generation)
        change["world"] = world_changed(status.world, WorldChange(
            generation=generation, size=0, racks=0, cross_rack_edges=0, rack_members=[]))
        told = (event("WorldPublished", f"generation {generation}: empty (suspended)"),)
    return Outcome(
        status=change, world=emptied, world_version=r.obs.world_version, events=told,
        delete_gracefully=tuple(p.name for p in r.pods if p.state != PodState.DELETING),
        moves=(Move(JobPhase.SUSPENDED, "Suspended", "spec.runPolicy.suspend is true; "
                    "pods stop with their grace period, restarts are kept"),),
        conditions=(SetCondition("Suspended", True, "Suspended",
                                 "pods deleted; the job is kept"),))


def resumption(status: TrainingJobStatus) -> Outcome:
    """A suspended job whose spec no longer suspends it starts over from Pending.

    Sets: phase Pending, condition Suspended (False)."""
    if status.phase != JobPhase.SUSPENDED:
        return NOTHING
    return Outcome(moves=(Move(JobPhase.PENDING, "Resumed", "spec.runPolicy.suspend is false"),),
                   conditions=(SetCondition("Suspended", False, "Resumed",
                                            "pods are recreated"),))


def deadline(r: Round, status: TrainingJobStatus) -> Outcome:
    """activeDeadlineSeconds counts from the job's creation, through Pending and Suspended
    too: a job that never becomes schedulable still ends, and says why.

    Sets: phase Failed (DeadlineExceeded or NeverSchedulable), which stops the round; or a
    requeue for when the deadline passes."""
    limit = r.spec.run_policy.active_deadline_seconds
    start = parse_time(r.meta.get("creationTimestamp")) or parse_time(status.start_time)
    if limit is None or start is None:
        return NOTHING
    if r.now - start < limit:
        return Outcome(requeue=start + limit - r.now)
    placed = find_condition(status, "Schedulable")
    if status.start_time is None and status.phase == JobPhase.PENDING:
        why = (f"{placed.reason}: {placed.message}"
               if placed is not None and placed.status == ConditionStatus.FALSE
               else "its pods never all became ready")
        move = Move(JobPhase.FAILED, "NeverSchedulable", f"not running {limit}s after "
                    f"creation (spec.runPolicy.activeDeadlineSeconds): {why}")
    else:
        move = Move(JobPhase.FAILED, "DeadlineExceeded",
                    f"more than spec.runPolicy.activeDeadlineSeconds={limit} since creation")
    return Outcome(moves=(move,), stop=True)


def completed(r: Round, status: TrainingJobStatus) -> Outcome:
    """The completion rule of the job's mode.

    Sets: status.workersFinishedTime; phase Succeeded, which stops the round; ``finishing``
    while the work is done but pods are still ending."""
    verdict = completion(r.spec.mode, r.obs.world, r.workers, r.ps,
                         parse_time(status.workers_finished_time), r.now,
                         r.settings.ps_exit_grace_seconds)
    change = StatusChange()
    if verdict.workers_finished_at is not None:
        change["workers_finished_time"] = rfc3339(verdict.workers_finished_at)
    moves = ((Move(JobPhase.SUCCEEDED, "Completed", verdict.message),)
             if verdict.succeeded else ())
    return Outcome(status=change, moves=moves, requeue=verdict.wait,
                   finishing=verdict.finishing, stop=verdict.succeeded)


def below_min(r: Round, status: TrainingJobStatus, phase: JobPhase, ready: int) -> Outcome:
    """A running job with fewer than spec.workers.min ready workers is Restarting, and
    Failed once that lasts longer than the grace period.

    ``phase`` is the job's phase by now (the world step may have moved it).
    Sets: status.belowMinSince; phase Restarting, then Failed; a requeue for the grace."""
    if phase not in (JobPhase.RUNNING, JobPhase.RESTARTING) or ready >= r.spec.workers.min:
        return Outcome(status=StatusChange(below_min_since=None))
    change = StatusChange()
    since = parse_time(status.below_min_since)
    if since is None:
        since = r.now
        change["below_min_since"] = rfc3339(r.now)
    minimum = r.spec.workers.min
    moves: list[Move] = []
    if phase == JobPhase.RUNNING:
        moves.append(Move(JobPhase.RESTARTING, "BelowMinimum",
                          f"{ready} ready workers, below spec.workers.min={minimum}; "
                          "waiting for replacements"))
    grace = r.settings.below_min_grace_seconds
    if r.now - since >= grace:
        moves.append(Move(JobPhase.FAILED, "BelowMinimum",
                          f"fewer than spec.workers.min={minimum} workers for {grace:.0f}s"))
        return Outcome(status=change, moves=tuple(moves))
    return Outcome(status=change, moves=tuple(moves),
                   requeue=max(grace - (r.now - since), 0.5))
