"""The round's bookkeeping that other tests only touch: the phase history's length, the
worker counts in the status, and how long a failed collective waits for a verdict."""

from __future__ import annotations

from typing import Any, get_type_hints

import pytest

from ringwright.objects import Obj
from ringwright.operator.api.conditions import rfc3339
from ringwright.operator.api.models import TrainingJobSpec, TrainingJobStatus, WorldSummary
from ringwright.operator.plan.round.status import (
    PHASE_HISTORY,
    LifecycleChange,
    StatusChange,
    WorldChange,
)
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
    report = {"tj-worker-1": Report(kind=ReportKind.COLLECTIVE_FAILED, generation=4, at=NOW)}

    def round_at(now: float) -> Any:
        return run(job(status={"phase": "Running"}), pods=pods,
                   world=world_of(range(4), generation=4), reports=report, now=now)

    first = round_at(NOW)
    assert first.world is None  # the heartbeats may still name a dead member
    assert first.requeue_after == pytest.approx(wait)
    assert round_at(NOW + wait - 0.1).world is None
    assert round_at(NOW + wait).world is not None


@pytest.mark.parametrize(("change", "model"), [(StatusChange, TrainingJobStatus),
                                               (LifecycleChange, TrainingJobStatus),
                                               (WorldChange, WorldSummary)])
def test_a_change_names_fields_of_its_model_with_their_types(change: type,
                                                              model: type[Any]) -> None:
    fields = model.model_fields
    for name, hint in get_type_hints(change).items():
        assert name in fields, name
        assert fields[name].annotation == hint, name


def _nones(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [k for k, v in value.items() if v is None] + [
            n for v in value.values() for n in _nones(v)]
    if isinstance(value, list):
        return [n for v in value for n in _nones(v)]
    return []


def test_the_status_is_written_in_its_wire_form_with_what_the_round_leaves_alone() -> None:
    before: Obj = {"phase": "Running", "candidate": None,
                   "lastCheckpoint": {"path": "/ckpt/7", "step": 7},
                   "world": {"generation": 4, "size": 4, "configMap": "tj-world"}}
    result = run(job(status=before), pods=[pod(i) for i in range(4)],
                 world=world_of(range(4), generation=4))
    st = result.status
    assert st == TrainingJobStatus.model_validate(st).to_wire()
    assert _nones(st) == []  # unset optionals are left out, never written as null
    assert st["lastCheckpoint"] == {"path": "/ckpt/7", "step": 7}
    assert st["world"]["configMap"] == "tj-world" and st["world"]["generation"] == 4
    assert st["observedGeneration"] == 3 and st["selector"].startswith("ringwright.dev/")


def test_a_condition_keeps_its_transition_time_until_it_flips() -> None:
    def found(result: Any) -> Obj:
        return next(c for c in result.status["conditions"] if c["type"] == "PolicyFound")

    first = run(job())
    assert found(first)["lastTransitionTime"] == rfc3339(NOW)
    again = run(job(status=first.status), now=NOW + 10)
    assert found(again)["lastTransitionTime"] == rfc3339(NOW)
    flipped = run(job(status=again.status), policy=False, now=NOW + 20)
    assert found(flipped)["status"] == "False"
    assert found(flipped)["lastTransitionTime"] == rfc3339(NOW + 20)
