"""When a push updates the parameters: sync rounds (k of n) or bounded-staleness async.

Pure decisions; the shard server holds the lock and applies what these decide.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

DEFAULT_STALENESS = 8
"""τ of async mode when the job spec sets none (the CRD documents the same value)."""


class Mode(StrEnum):
    SYNC = "sync"
    ASYNC = "async"


@dataclass(frozen=True)
class Consistency:
    """``sync``: a step's update applies once all current workers (less ``backup_workers``)
    pushed for it. ``async``: every push applies at once unless it was computed from
    parameters more than ``tau`` versions old; then it is dropped and counted."""

    mode: Mode = Mode.SYNC
    tau: int = 0
    backup_workers: int = 0

    def __post_init__(self) -> None:
        if self.tau < 0 or self.backup_workers < 0:
            raise ValueError("tau and backup_workers must be >= 0")

    def needed(self, workers: int) -> int:
        """Pushes that complete a sync round among ``workers`` current workers."""
        return max(1, workers - self.backup_workers)

    def to_json(self) -> dict[str, object]:
        return {"mode": self.mode.value, "tau": self.tau, "backupWorkers": self.backup_workers}

    @classmethod
    def from_json(cls, doc: dict[str, object]) -> Consistency:
        tau, backup = doc.get("tau", 0), doc.get("backupWorkers", 0)
        return cls(Mode(str(doc.get("mode", "sync"))),
                   tau if isinstance(tau, int) else 0,
                   backup if isinstance(backup, int) else 0)


class Verdict(StrEnum):
    APPLY = "apply"
    """Apply now (async) or complete the round with it (sync)."""
    BUFFER = "buffer"
    """Sync: keep it for the current round, which still waits for others."""
    STALE = "stale"
    """Computed from parameters too old: dropped and counted."""
    DUPLICATE = "duplicate"
    """Sync: this worker already pushed for the current round."""


def judge(consistency: Consistency, version: int, pushed_from: int,
          contributed: bool, contributors: int, workers: int) -> Verdict:
    """The fate of a push computed from ``pushed_from`` when the shard is at ``version``.

    ``contributed``: the pusher already pushed in this sync round; ``contributors``:
    how many pushed so far (without this one); ``workers``: current workers.
    """
    if pushed_from > version:
        raise ValueError(f"push from version {pushed_from} ahead of the shard at {version}")
    if consistency.mode is Mode.ASYNC:
        return Verdict.STALE if version - pushed_from > consistency.tau else Verdict.APPLY
    if pushed_from < version:
        return Verdict.STALE
    if contributed:
        return Verdict.DUPLICATE
    return Verdict.APPLY if contributors + 1 >= consistency.needed(workers) else Verdict.BUFFER


def round_complete(consistency: Consistency, contributors: int, workers: int) -> bool:
    """Sync: whether a round with ``contributors`` pushes may apply now (after a worker
    left, fewer may suffice)."""
    return contributors > 0 and contributors >= consistency.needed(workers)
