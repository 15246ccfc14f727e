"""The step of a job queued through Kueue: no pods before admission, Kueue's reason shown."""

from __future__ import annotations

from dataclasses import replace

from ...api.models import ConditionStatus, JobPhase, TrainingJobStatus
from ..kueue import Admission
from .lifecycle import suspension
from .state import Move, Outcome, Round, SetCondition, earliest, event
from .status import find_condition

QUEUED, ADMITTED = "Queued", "Admitted"
WAITING_FOR_QUOTA = "WaitingForQuota"
RESIZABLE = "Resizable"
TOPOLOGY_ASSIGNED = "TopologyAssigned"


def queue(r: Round, status: TrainingJobStatus, given: Admission) -> Outcome:
    """Conditions Queued and Admitted from Kueue's answer; until admission, nothing is
    created; the watch on the job's Workload wakes it when Kueue answers (the resync is
    the backstop). A job that has pods or a world when it is not admitted (Kueue evicted it)
    is suspended as ``spec.runPolicy.suspend`` would: an empty world, pods deleted with
    their grace period (SIGTERM: the runtime writes its checkpoint), restarts kept; on
    readmission it resumes from Suspended.

    Sets: conditions Queued and Admitted, an event when admission flips; when evicted,
    what :func:`suspension` sets. Stops the round while not admitted."""
    current = find_condition(status, ADMITTED)
    was_admitted = current is not None and current.status == ConditionStatus.TRUE
    message = given.message or given.reason
    if given.admitted:
        flavors = "; ".join(f"{ps}: {', '.join(fl)}" for ps, fl in sorted(given.flavors.items())
                            if fl)
        text = message + (f" (flavors {flavors})" if flavors else "")
        return Outcome(
            conditions=(SetCondition(ADMITTED, True, given.reason, text),
                        SetCondition(QUEUED, False, given.reason, text)),
            events=() if was_admitted else (event(ADMITTED, f"admitted by Kueue: {text}"),))
    told = current is None or was_admitted or current.reason != given.reason
    queued = Outcome(
        conditions=(SetCondition(QUEUED, True, given.reason, message),
                    SetCondition(ADMITTED, False, given.reason, message)),
        events=(event(QUEUED, f"waiting for Kueue: {given.reason}: {message}"),)
        if told else (),
        requeue=r.settings.resync_seconds, stop=True)
    world = r.obs.world
    if not r.pods and not (world is not None and (world.members or world.ps)):
        return queued
    stopped = suspension(r, status)
    return replace(
        stopped, conditions=(*queued.conditions, SetCondition(
            "Suspended", True, given.reason, f"evicted by Kueue: {message}")),
        events=queued.events + stopped.events,
        requeue=earliest(stopped.requeue, r.settings.resync_seconds), stop=True,
        moves=(Move(JobPhase.SUSPENDED, given.reason,
                    f"evicted by Kueue ({message}); pods stop with their grace period, "
                    "restarts are kept, and the job resumes once admitted again"),))


def quota_wait(status: TrainingJobStatus, waiting: str) -> Outcome:
    """Condition WaitingForQuota while the job asks Kueue for more workers than it was
    admitted with (``waiting`` says how many and Kueue's answer); cleared once admitted.

    Sets: condition WaitingForQuota (only on a job that has or needs it), an event when
    the wait begins."""
    current = find_condition(status, WAITING_FOR_QUOTA)
    was_waiting = current is not None and current.status == ConditionStatus.TRUE
    if waiting:
        return Outcome(conditions=(SetCondition(WAITING_FOR_QUOTA, True, "ScaleUpQueued",
                                                waiting),),
                       events=() if was_waiting else (event(WAITING_FOR_QUOTA, waiting),))
    if was_waiting:
        return Outcome(conditions=(SetCondition(WAITING_FOR_QUOTA, False, "Admitted",
                                                "Kueue admitted every worker asked for"),))
    return Outcome()


def topology_fixed(status: TrainingJobStatus, fixed: str) -> Outcome:
    """Condition Resizable=False while the job asks for another number of workers than
    Kueue admitted and its topology request keeps it at the admitted size (``fixed``
    says why); back to True once the two agree.

    Sets: condition Resizable (only on a job that has or needs it), an event when it
    becomes False."""
    return _flag(status, RESIZABLE, "TopologyAssigned", fixed, "NotResized",
                 "the job runs the workers it asks for")


def topology_dropped(status: TrainingJobStatus, dropped: str) -> Outcome:
    """Condition TopologyAssigned=False while Kueue admitted a pod set without the
    required or preferred topology it asked for (``dropped`` says which and what to do).

    Sets: condition TopologyAssigned (only on a job that has or needs it), an event when
    it becomes False."""
    return _flag(status, TOPOLOGY_ASSIGNED, "KueueDroppedRequest", dropped,
                 "TopologyDropped", "Kueue assigned the topology asked for")


def _flag(status: TrainingJobStatus, type_: str, reason: str, problem: str,
          event_reason: str, cleared: str) -> Outcome:
    """Condition ``type_`` False with ``problem`` (an event when it starts), True again
    with ``cleared`` once the problem is gone; nothing on a job that never had it."""
    current = find_condition(status, type_)
    was_false = current is not None and current.status == ConditionStatus.FALSE
    if problem:
        return Outcome(conditions=(SetCondition(type_, False, reason, problem),),
                       events=() if was_false else (event(event_reason, problem),))
    if was_false:
        return Outcome(conditions=(SetCondition(type_, True, "Admitted", cleared),))
    return Outcome()
