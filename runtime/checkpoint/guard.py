"""Checkpoint errors are reported, never fatal: a full disk must not stop training.

:class:`CheckpointGuard` sits between the training state and its checkpointer. A write
that fails (in the background or at once), a restore from storage that cannot be read:
each becomes one log line, a report to the operator (which shows it as the job's
``CheckpointFailing`` condition, with the path and the OS error) and a retry after a
backoff that doubles up to a cap, while training carries on from memory. The first
write that succeeds after a failure is reported too, so the condition clears.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ..kvlog import log_event, runtime_logger
from .format import CheckpointError, UnsupportedPayload

_log = runtime_logger("checkpoint")


class RestoredCheckpoint(Protocol):
    """A checkpoint read back: the payload that the training state produced."""

    @property
    def payload(self) -> dict[str, Any]:
        """The saved payload, tensors in host memory."""
        ...


class Checkpointer(Protocol):
    """Durable snapshots; :class:`.checkpointer.Checkpointer` is one."""

    def save(self, step: int, payload: Mapping[str, Any],
             meta: Mapping[str, Any] | None = None, *, copy: bool = True) -> None:
        """Write ``payload`` as ``step``'s checkpoint in the background; ``copy=False``
        when the payload is already a private host copy that nothing will change."""
        ...

    def flush(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the pending write; True when it is done."""
        ...

    def restore_latest(self) -> RestoredCheckpoint | None:
        """The newest checkpoint that verifies, or None."""
        ...


@dataclass(frozen=True)
class Backoff:
    """Delay before the next attempt after ``failures`` consecutive failures."""

    base_s: float = 5.0
    cap_s: float = 300.0

    def delay(self, failures: int) -> float:
        """0 without failures, then base, 2 x base, 4 x base, ... up to the cap."""
        if failures <= 0:
            return 0.0
        return float(min(self.base_s * 2 ** (failures - 1), self.cap_s))


FailureReport = Callable[[str, bool], None]
"""Told ``(detail, failing)``: a failure with its detail, or ``failing=False`` once
checkpoints succeed again."""


class CheckpointGuard:
    """Runs checkpointer calls; turns storage errors into reports and backed-off retries."""

    def __init__(self, checkpointer: Checkpointer, *, clock: Callable[[], float],
                 where: str = "", backoff: Backoff = Backoff()) -> None:
        self.checkpointer = checkpointer
        self.where = where
        """Where checkpoints go (the job's path), for messages; empty when unknown."""
        self.report: FailureReport | None = None
        """Where failures go besides the log; set by the elastic runtime."""
        self.failures = 0
        """Consecutive failed attempts."""
        self._clock = clock
        self._backoff = backoff
        self._retry_at = 0.0
        self._pending: int | None = None
        self._pending_since = 0.0
        self.last_write_s: float | None = None
        """How long the last good write took, from its start until it was seen done (at
        the next look: a commit or a flush); None before the first."""

    def may_write(self) -> bool:
        """Whether an attempt is allowed now (not while backing off after a failure)."""
        self.poll()
        return self._clock() >= self._retry_at

    def save(self, step: int, payload: Mapping[str, Any], meta: Mapping[str, Any]) -> bool:
        """Start writing ``payload`` (a private host copy); False when it failed to start.

        A payload holding objects a checkpoint cannot store is the script's bug, not the
        storage's: that still raises.
        """
        # The checkpointer would wait for the previous write anyway; waiting here first
        # attributes a failure of that write to its own step, and backs off after it.
        if self._pending is not None and not self.flush(None):
            return False
        try:
            self.checkpointer.save(step, payload, meta, copy=False)
        except UnsupportedPayload:
            raise
        except (CheckpointError, OSError) as err:
            self._failed(step, err)
            return False
        self._pending, self._pending_since = step, self._clock()
        return True

    def poll(self) -> None:
        """Notice a background write that finished (or failed) since the last look."""
        if self._pending is not None:
            self.flush(0.0)

    def flush(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` s for the pending write; True when it is done and good."""
        step = self._pending
        try:
            if not self.checkpointer.flush(timeout):
                return False
        except (CheckpointError, OSError) as err:
            self._pending = None
            self._failed(step, err)
            return False
        self._pending = None
        if step is not None:
            self.last_write_s = self._clock() - self._pending_since
        if step is not None and self.failures:
            log_event(_log, logging.INFO, "checkpoint_recovered", step=step,
                      failed_attempts=self.failures)
            self.failures, self._retry_at = 0, 0.0
            if self.report is not None:
                self.report(f"checkpoint of step {step} written", False)
        return True

    def restore_latest(self) -> RestoredCheckpoint | None:
        """The newest good checkpoint; None (reported) when storage cannot be read."""
        try:
            return self.checkpointer.restore_latest()
        except (CheckpointError, OSError) as err:
            self._failed(None, err, reading=True)
            return None

    def _failed(self, step: int | None, err: BaseException, *, reading: bool = False) -> None:
        self.failures += 1
        delay = self._backoff.delay(self.failures)
        self._retry_at = self._clock() + delay
        what = "reading checkpoints" if reading else f"writing the checkpoint of step {step}"
        where = f" {'from' if reading else 'to'} {self.where}" if self.where else ""
        detail = f"{what}{where} failed: {err}"
        log_event(_log, logging.ERROR, "checkpoint_failed", step=step, reading=reading,
                  error=err, failures=self.failures, retry_in_s=delay)
        if self.report is not None:
            self.report(detail, True)
