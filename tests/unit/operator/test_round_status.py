"""The round's bookkeeping that other tests only touch: the phase history's length, the
worker counts in the status, and how long a failed collective waits for a verdict."""

from __future__ import annotations

from typing import Any

import pytest

from ringwright.operator.api.models import TrainingJobSpec
from ringwright.operator.plan.round.state import PHASE_HISTORY
from ringwright.operator.plan.round.world import VERDICT_MARGIN_S
from ringwright.world import Report, ReportKind
from tests.unit.operator.test_reconcile import NOW, job, pod, run, world_of


def test_phase_history_keeps_only_the_latest_transitions() -> None:
    history = [{"phase": "Pending", "reason": f"r{i}", "time": "1970-01-01T00:00:00Z"}
               for i in range(PHASE_HISTORY)]
    result = run(job(status={"phase": "Pending", "phaseHistory": history}),
                 pods=[pod(i) for i in range(4)])
    assert result.status["phase"] == "Running"
    kept = result.status["phaseHistory"]
    assert len(kept) == PHASE_HISTORY
    assert kept[0]["reason"] == "r1"  # the oldest went first
    assert kept[-1]["phase"] == "Running"


def test_status_counts_workers_by_state() -> None:
    pods = [pod(0), pod(1), pod(2, ready=False), pod(3, phase="Failed"), pod(4, phase="Succeeded")]
    result = run(job(replicas=4, status={"phase": "Running"}), pods=pods,
                 world=world_of([0, 1, 2, 3]))
    assert result.delete == ["tj-worker-3"]
    assert result.create == []  # the replacement waits out its backoff
    assert result.status["workers"] == {"desired": 4, "active": 3, "ready": 2, "succeeded": 1,
                                        "failed": 1}


def test_a_failed_collective_waits_failure_detect_seconds_plus_the_margin() -> None:
    spec = TrainingJobSpec.model_validate(job()["spec"])
    wait = spec.fault_tolerance.failure_detect_seconds + VERDICT_MARGIN_S
    pods = [pod(i) for i in range(4)]
    report = {"tj-worker-1": Report(kind=ReportKind.COLLECTIVE_FAILED, epoch=4, at=NOW)}

    def round_at(now: float) -> Any:
        return run(job(status={"phase": "Running"}), pods=pods, world=world_of(range(4), epoch=4),
                   reports=report, now=now)

    first = round_at(NOW)
    assert first.world is None  # the heartbeats may still name a dead member
    assert first.requeue_after == pytest.approx(wait)
    assert round_at(NOW + wait - 0.1).world is None
    assert round_at(NOW + wait).world is not None
