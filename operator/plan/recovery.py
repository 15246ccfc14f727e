"""How long a job took to recover from a lost pod, as recorded in its status."""

from __future__ import annotations

from ringwright.objects import Obj

from ..api.conditions import parse_time


def recovery(status: Obj, now: float) -> Obj | None:
    """``status.lastRecovery`` for a world published at ``now``; None when unchanged.

    A recovery ends with the first world published after a loss was noticed
    (``lastFailureTime``); later epochs (a replacement joining) do not move it.
    Timestamps in status have whole seconds, so the figure is good to about a second.
    """
    failure = status.get("lastFailureTime")
    noticed = parse_time(failure)
    if noticed is None or (status.get("lastRecovery") or {}).get("failureTime") == failure:
        return None
    return {"failureTime": failure, "seconds": round(max(now - noticed, 0.0), 3)}
