"""The job lifecycle as a table: which phase may follow which, and why.

Every transition the planner proposes is checked against :data:`TRANSITIONS`;
a transition that is not in the table is a bug in the planner, not a user error.
"""

from __future__ import annotations

from ..api.models import JobPhase

P = JobPhase

TRANSITIONS: dict[JobPhase, frozenset[JobPhase]] = {
    P.PENDING: frozenset({P.RUNNING, P.FAILED, P.SUSPENDED, P.SUCCEEDED}),
    P.RUNNING: frozenset({P.RESTARTING, P.SUCCEEDED, P.FAILED, P.SUSPENDED}),
    P.RESTARTING: frozenset({P.RUNNING, P.FAILED, P.SUSPENDED, P.SUCCEEDED}),
    P.SUSPENDED: frozenset({P.PENDING, P.FAILED}),
    P.SUCCEEDED: frozenset(),
    P.FAILED: frozenset(),
}
"""Allowed next phases. Succeeded and Failed are final."""

TERMINAL = frozenset({P.SUCCEEDED, P.FAILED})


class IllegalTransition(AssertionError):
    """The planner proposed a phase change the lifecycle table forbids."""


def check_transition(current: JobPhase, nxt: JobPhase) -> JobPhase:
    """Return ``nxt`` when ``current -> nxt`` is allowed (staying put always is)."""
    if nxt != current and nxt not in TRANSITIONS[current]:
        raise IllegalTransition(f"phase {current} may not become {nxt}")
    return nxt
