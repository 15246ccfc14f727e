"""The ``CheckpointFailing`` condition, decided from what the job's pods report.

A member whose checkpoint write (or read) fails keeps training and reports
``checkpoint-failed`` with the path and the OS error; once a write succeeds again it
reports ``checkpoint-ok``. The job's condition follows the newest such report.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from ringwright.world import Report, ReportKind

from ...api.models import Condition, ConditionStatus

CONDITION = "CheckpointFailing"


class ConditionChange(NamedTuple):
    """The condition to set: ``failing`` is its status."""

    failing: bool
    reason: str
    message: str


def checkpoint_condition(reports: Mapping[str, Report], current: Condition | None
                         ) -> ConditionChange | None:
    """What ``CheckpointFailing`` should say; None leaves it as it is (or absent).

    The condition appears only once a member reports a failure, and turns False when
    no member reports one any longer.
    """
    failing = [(r.at, pod, r) for pod, r in reports.items()
               if r.kind == ReportKind.CHECKPOINT_FAILED]
    if failing:
        _, pod, report = max(failing)
        return ConditionChange(True, "CheckpointWriteFailed",
                               f"{pod} (world generation {report.generation}): {report.detail}; "
                               "training continues from memory and the write is retried")
    if current is None or current.status != ConditionStatus.TRUE:
        return None
    ok = [(r.at, pod, r) for pod, r in reports.items() if r.kind == ReportKind.CHECKPOINT_OK]
    message = f"{max(ok)[1]}: {max(ok)[2].detail}" if ok else \
        "no member reports a checkpoint failure"
    return ConditionChange(False, "CheckpointsWritten", message)
