"""Writes the API server refuses: told to the user, remembered per job, retried with backoff.

A quota, an admission policy or a webhook can refuse any create or patch, and will refuse
the next one just the same. A refusal therefore never aborts a round: it becomes a
``FailedCreate`` / ``FailedUpdate`` Warning event with the API's message and the
``WritesAccepted=False`` condition, the rest of the round (world, deletes, status) still
happens, and the job's creates wait out a per-job backoff before they are tried again.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ringwright.kube import ApiError
from ringwright.objects import Obj

from ..api.models import Condition, ConditionStatus
from ..plan.round.status import with_condition

CONDITION = "WritesAccepted"
"""False while the API server refuses the job's creates or patches (reason says which)."""

_RETRIED = frozenset({409, 429})
"""Conflicts and throttling: answers about timing, not refusals; the round is retried."""


def is_refusal(err: ApiError) -> bool:
    """True for a 4xx that the same request would get again (quota, admission, invalid)."""
    return 400 <= err.status < 500 and err.status not in _RETRIED


MAX_DOUBLINGS = 64
"""Refusals counted at most: 2**63 times any base is past every cap."""


@dataclass(frozen=True)
class Refused:
    """One write the API server refused."""

    verb: str
    """``create`` (POST, or the apply that makes an object), ``update`` or ``delete``."""
    kind: str
    name: str
    message: str

    @property
    def reason(self) -> str:
        """The event and condition reason, as Kubernetes' own controllers name them."""
        return {"create": "FailedCreate", "delete": "FailedDelete"}.get(self.verb,
                                                                        "FailedUpdate")

    def describe(self) -> str:
        """What was refused and the API server's words."""
        return f"{self.verb} {self.kind} {self.name}: {self.message}"


def refused(verb: str, kind: str, name: str, err: ApiError) -> Refused:
    """A :class:`Refused` from the API's error."""
    return Refused(verb, kind, name, err.message or str(err))


def refusal_conditions(conditions: list[Obj], refusals: list[Refused], attempted: bool,
                       now: float, generation: int) -> list[Obj]:
    """``conditions`` with ``WritesAccepted`` set from this round's refusals.

    The first refusal names the condition's reason. A round that attempted its writes
    with none refused clears a False condition; a round that held them back (backoff)
    leaves it as it was. The status the round wrote is plain JSON here, so the typed
    rule of :func:`~ringwright.operator.plan.round.status.with_condition` is applied
    to it and the result written back in the same form.
    """
    typed = [Condition.model_validate(c) for c in conditions]
    if refusals:
        first = refusals[0]
        more = f" (and {len(refusals) - 1} more refused writes)" if len(refusals) > 1 else ""
        typed = with_condition(typed, CONDITION, False, first.reason,
                               first.describe() + more, now, generation)
    elif attempted and any(c.type == CONDITION and c.status is ConditionStatus.FALSE
                           for c in typed):
        typed = with_condition(typed, CONDITION, True, "Accepted",
                               "the API server accepts the job's writes again", now, generation)
    else:
        return conditions
    return [c.model_dump(mode="json", by_alias=True, exclude_none=True) for c in typed]


@dataclass
class RefusalBackoff:
    """Per job: after a refused write, hold creates for base, 2·base … cap seconds."""

    base: float
    cap: float
    _jobs: dict[tuple[str, str], tuple[int, float]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def hold_until(self, job: tuple[str, str], now: float) -> float | None:
        """Until when the job's creates wait; None when they may go now."""
        with self._lock:
            entry = self._jobs.get(job)
        if entry is None or entry[1] <= now:
            return None
        return entry[1]

    def refused(self, job: tuple[str, str], now: float) -> float:
        """Note a round with refusals; returns when creates may be tried again."""
        with self._lock:
            # The count stops growing once the delay is capped: a write refused for hours
            # (a namespace being deleted) must not overflow the float.
            count = min(self._jobs.get(job, (0, now))[0] + 1, MAX_DOUBLINGS)
            until = now + min(self.cap, self.base * 2.0 ** (count - 1))
            self._jobs[job] = (count, until)
        return until

    def accepted(self, job: tuple[str, str]) -> None:
        """Note a round whose writes all went through (or a job that is gone)."""
        with self._lock:
            self._jobs.pop(job, None)
