"""A member's checkpoint-failure report becomes the job's CheckpointFailing condition
(with the path and the OS error), a warning event, and clears when writes succeed."""

from __future__ import annotations

from ringwright.operator.api.conditions import condition
from ringwright.world import Report, ReportKind
from tests.unit.operator.test_reconcile import NOW, job, pod, run, world_of

DETAIL = ("writing the checkpoint of step 40 to /ckpt failed: writing checkpoint model failed:"
          " [Errno 30] Read-only file system: '/ckpt/model'")


def running(status_extra: dict[str, object] | None = None) -> dict[str, object]:
    return {"phase": "Running", **(status_extra or {})}


def test_a_failure_report_sets_the_condition_and_warns_once() -> None:
    pods = [pod(i) for i in range(4)]
    failed = Report(kind=ReportKind.CHECKPOINT_FAILED, generation=1, at=NOW, detail=DETAIL)
    result = run(job(status=running()), pods=pods, world=world_of(range(4)),
                 reports={"tj-worker-0": failed})
    cond = condition(result.status["conditions"], "CheckpointFailing")
    assert cond is not None and cond["status"] == "True"
    assert cond["reason"] == "CheckpointWriteFailed"
    assert "/ckpt" in cond["message"] and "Read-only file system" in cond["message"]
    assert "tj-worker-0" in cond["message"]
    assert [e.reason for e in result.events] == ["CheckpointWriteFailed"]
    assert result.delete == [] and result.world is None, "nothing restarts over it"

    again = run(job(status=result.status), pods=pods, world=world_of(range(4)),
                reports={"tj-worker-0": failed})
    assert again.events == [], "the event is not repeated while the condition holds"


def test_a_later_success_clears_it() -> None:
    pods = [pod(i) for i in range(4)]
    failed = Report(kind=ReportKind.CHECKPOINT_FAILED, generation=1, at=NOW, detail=DETAIL)
    first = run(job(status=running()), pods=pods, world=world_of(range(4)),
                reports={"tj-worker-0": failed})
    ok = Report(kind=ReportKind.CHECKPOINT_OK, generation=1, at=NOW + 30,
                detail="checkpoint of step 60 written")
    later = run(job(status=first.status), pods=pods, world=world_of(range(4)),
                reports={"tj-worker-0": ok})
    cond = condition(later.status["conditions"], "CheckpointFailing")
    assert cond is not None and cond["status"] == "False"
    assert cond["reason"] == "CheckpointsWritten" and "step 60" in cond["message"]


def test_jobs_without_failures_carry_no_such_condition() -> None:
    result = run(job(status=running()), pods=[pod(i) for i in range(4)],
                 world=world_of(range(4)))
    assert condition(result.status.get("conditions") or [], "CheckpointFailing") is None
