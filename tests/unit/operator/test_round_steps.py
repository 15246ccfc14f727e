"""How a round records its steps: outcomes are data, the draft applies them in order."""

from __future__ import annotations

import pytest

from ringwright.operator.api.models import JobPhase, TrainingJobStatus
from ringwright.operator.plan.phases import IllegalTransition
from ringwright.operator.plan.round.draft import Draft
from ringwright.operator.plan.round.lifecycle import resumption
from ringwright.operator.plan.round.state import (
    NOTHING,
    Move,
    Outcome,
    SetCondition,
    event,
    merged,
)
from ringwright.operator.plan.round.status import StatusChange
from tests.unit.operator.test_reconcile import NOW


def _draft(phase: JobPhase) -> Draft:
    return Draft(TrainingJobStatus(phase=phase), NOW, generation=3)


def test_a_steps_events_come_before_those_of_its_moves() -> None:
    d = _draft(JobPhase.RUNNING)
    d.take(Outcome(events=(event("MemberLost", "lost tj-worker-1"),),
                   moves=(Move(JobPhase.FAILED, "BackoffLimitExceeded", "too many"),)))
    assert [e.reason for e in d.plan.events] == ["MemberLost", "BackoffLimitExceeded"]
    assert d.plan.events[1].message == "Running -> Failed: too many"
    assert d.phase == JobPhase.FAILED and d.status.completion_time is not None
    failed = next(c for c in d.status.conditions if c.type == "Failed")
    assert failed.reason == "BackoffLimitExceeded" and failed.observed_generation == 3


def test_the_draft_refuses_a_move_the_lifecycle_forbids() -> None:
    with pytest.raises(IllegalTransition):
        _draft(JobPhase.SUCCEEDED).take(Outcome(moves=(Move(JobPhase.RUNNING, "x", "y"),)))


def test_staying_in_a_phase_is_no_move() -> None:
    d = _draft(JobPhase.SUSPENDED)
    d.take(Outcome(moves=(Move(JobPhase.SUSPENDED, "Suspended", "again"),)))
    assert d.plan.events == [] and d.status.phase_history == []


def test_merged_parts_keep_their_order_and_the_earliest_requeue() -> None:
    first = Outcome(status=StatusChange(restarts=1), delete=("a",), requeue=2.0,
                    conditions=(SetCondition("X", True, "R", "m"),))
    second = Outcome(status=StatusChange(restarts=2, selector="s"), delete=("b",),
                     requeue=5.0, moves=(Move(JobPhase.RUNNING, "Running", "m"),))
    both = merged(first, NOTHING, second)
    assert both.status == {"restarts": 2, "selector": "s"}
    assert both.delete == ("a", "b") and both.requeue == 2.0
    assert len(both.conditions) == 1 and len(both.moves) == 1 and not both.stop


def test_a_step_reads_only_what_it_is_given() -> None:
    # Resuming needs nothing but the status: a job not suspended has nothing to resume.
    assert resumption(TrainingJobStatus(phase=JobPhase.RUNNING)) is NOTHING
    back = resumption(TrainingJobStatus(phase=JobPhase.SUSPENDED))
    assert [m.phase for m in back.moves] == [JobPhase.PENDING]
    assert [(c.type, c.ok) for c in back.conditions] == [("Suspended", False)]
