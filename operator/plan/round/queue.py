"""The step of a job queued through Kueue: no pods before admission, Kueue's reason shown."""

from __future__ import annotations

from ...api.models import ConditionStatus, TrainingJobStatus
from ..kueue import Admission
from ..pods import PodState
from .state import Outcome, Round, SetCondition, event
from .status import find_condition

QUEUED, ADMITTED = "Queued", "Admitted"
POLL_SECONDS = 2.0
"""How soon a waiting job looks at its Workload again (a Workload event wakes it sooner)."""


def queue(r: Round, status: TrainingJobStatus, given: Admission) -> Outcome:
    """Conditions Queued and Admitted from Kueue's answer; until admission, nothing is
    created and pods that exist (an eviction) go with their grace period (SIGTERM: the
    runtime writes its checkpoint).

    Sets: conditions Queued and Admitted, an event when admission flips; the plan's
    delete_gracefully. Stops the round while not admitted."""
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
    leaving = tuple(p.name for p in r.pods if p.state != PodState.DELETING)
    return Outcome(
        conditions=(SetCondition(QUEUED, True, given.reason, message),
                    SetCondition(ADMITTED, False, given.reason, message)),
        events=(event(QUEUED, f"waiting for Kueue: {given.reason}: {message}"),)
        if told else (),
        delete_gracefully=leaving, requeue=POLL_SECONDS, stop=True)
