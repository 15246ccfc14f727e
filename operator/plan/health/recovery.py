"""How long a job took to recover from a lost pod, as recorded in its status."""

from __future__ import annotations

from ...api.conditions import parse_time
from ...api.models import RecoveryStatus, TrainingJobStatus


def recovery(status: TrainingJobStatus, now: float) -> RecoveryStatus | None:
    """``status.lastRecovery`` for a world published at ``now``; None when unchanged.

    A recovery ends with the first world published after a loss was noticed
    (``lastFailureTime``); later generations (a replacement joining) do not move it.
    Timestamps in status have whole seconds, so the figure is good to about a second.
    """
    failure = status.last_failure_time
    noticed = parse_time(failure)
    if failure is None or noticed is None or (
            status.last_recovery is not None and status.last_recovery.failure_time == failure):
        return None
    return RecoveryStatus(failure_time=failure, seconds=round(max(now - noticed, 0.0), 3))
