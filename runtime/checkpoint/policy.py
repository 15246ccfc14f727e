"""When to checkpoint: every N steps and/or T seconds, and once more on SIGTERM.

Both pieces are free of I/O and of torch so that the training loop can consult them on
every step. A loop that uses them::

    policy = CheckpointPolicy.from_settings(world.checkpoint)
    stop = TerminationSignal(grace_seconds=grace).install()
    last_step, last_time = start_step, time.monotonic()
    while True:
        train_one_step(); step += 1
        if stop.requested:
            # Kubernetes sent SIGTERM (preemption, scale-down, drain): save what the
            # step produced and wait for it, within what is left of the grace period.
            if checkpointer.last_saved_step != step:
                checkpointer.save(step, state.payload(), meta)
            checkpointer.flush(timeout=stop.remaining())
            break
        if policy.due(step=step, now=time.monotonic(), last_step=last_step,
                      last_time=last_time):
            checkpointer.save(step, state.payload(), meta)
            last_step, last_time = step, time.monotonic()

The signal handler only sets a flag: saving from inside a handler would snapshot a
half-updated model, since the handler runs between two arbitrary bytecodes of the step.
The flag is read at step boundaries, so a step stuck in a collective delays the final
checkpoint; the group manager's short collective timeouts bound that wait, and the last
periodic checkpoint stays valid if SIGKILL comes first.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

from ringwright.world import AUTO_MAX_STEPS, AUTO_MIN_STEPS

if TYPE_CHECKING:
    from ringwright.world import CheckpointSettings

KUBERNETES_DEFAULT_GRACE_SECONDS = 30.0
"""A pod's terminationGracePeriodSeconds when the pod spec does not set one."""


@dataclass(frozen=True)
class CheckpointPolicy:
    """Decides from step counts and a clock reading whether a checkpoint is due.

    ``interval_steps`` and ``interval_seconds`` of 0 disable that trigger; with both 0
    only SIGTERM (and explicit calls) checkpoint.
    """

    interval_steps: int = 0
    interval_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.interval_steps < 0 or self.interval_seconds < 0:
            raise ValueError(
                "checkpoint intervals must be >= 0 (0 disables one), got"
                f" intervalSteps={self.interval_steps}, intervalSeconds={self.interval_seconds}"
            )

    @classmethod
    def from_settings(cls, settings: CheckpointSettings) -> CheckpointPolicy:
        """The policy a job's world asks for (``world.checkpoint``)."""
        return cls(settings.interval_steps, settings.interval_seconds)

    @property
    def periodic(self) -> bool:
        """Whether any interval trigger is set."""
        return self.interval_steps > 0 or self.interval_seconds > 0

    def due(self, *, step: int, now: float, last_step: int, last_time: float) -> bool:
        """Whether to checkpoint after ``step``, at time ``now``.

        ``last_step`` and ``last_time`` are those of the previous checkpoint, or of the
        start (or restore) when there is none yet; ``now`` and ``last_time`` come from
        the same clock (a monotonic one: wall-clock jumps must not trigger checkpoints).
        Never due twice for one step.
        """
        if step <= last_step:
            return False
        if self.interval_steps and step - last_step >= self.interval_steps:
            return True
        return bool(self.interval_seconds) and now - last_time >= self.interval_seconds


STEP_TIME_WEIGHT = 0.1
"""Weight of the newest step in the moving average of the step time."""


def young_daly_seconds(mtbf_s: float, cost_s: float) -> float:
    """The Young/Daly optimum time between checkpoints, ``sqrt(2 * MTBF * cost)``.

    Checkpointing every ``T`` seconds costs ``cost_s / T`` of the time, and a failure
    throws away ``T / 2`` on average, once per ``mtbf_s``; their sum is least at
    ``T = sqrt(2 * mtbf_s * cost_s)`` (first order, for ``cost_s`` well below ``mtbf_s``).
    """
    if mtbf_s < 0 or cost_s < 0:
        raise ValueError(f"MTBF and cost must be >= 0, got {mtbf_s}, {cost_s}")
    return math.sqrt(2.0 * mtbf_s * cost_s)


def auto_interval_steps(*, mtbf_s: float, cost_s: float, step_s: float, min_steps: int,
                        max_steps: int) -> int:
    """The Young/Daly interval in steps of ``step_s`` seconds, within
    ``[min_steps, max_steps]`` (``min_steps`` when the step time is not known yet)."""
    if not 1 <= min_steps <= max_steps:
        raise ValueError(f"need 1 <= min_steps <= max_steps, got {min_steps}, {max_steps}")
    if step_s <= 0:
        return min_steps
    steps = young_daly_seconds(mtbf_s, cost_s) / step_s
    return max(min_steps, min(max_steps, round(steps)))


@dataclass(frozen=True)
class RestartHistory:
    """How often the whole job restarted (from a checkpoint): kept in the checkpoint, so
    it survives what it counts.

    ``started_at`` is the wall-clock time (seconds since the Unix epoch) of the job's
    first start; ``restarts`` the whole-job restarts since.
    """

    started_at: float
    restarts: int = 0

    def mtbf(self, now: float) -> float:
        """The observed mean time between whole-job restarts at wall time ``now``.

        With no restart yet, the time run so far: a lower bound that grows while the job
        stays up, so the interval lengthens as the job proves steady.
        """
        return max(now - self.started_at, 0.0) / max(self.restarts, 1)

    def restarted(self) -> RestartHistory:
        """The history after one more whole-job restart."""
        return RestartHistory(self.started_at, self.restarts + 1)

    def to_dict(self) -> dict[str, float | int]:
        """As stored with the state (plain JSON values)."""
        return {"startedAt": self.started_at, "restarts": self.restarts}

    @classmethod
    def from_dict(cls, doc: object, now: float) -> RestartHistory:
        """Read back :meth:`to_dict`; a state without one (older, or fresh) starts ``now``."""
        if not isinstance(doc, dict):
            return cls(now)
        return cls(float(doc.get("startedAt", now)), int(doc.get("restarts", 0)))


class AutoInterval:
    """``intervalSteps: Auto``: the Young/Daly interval from what this member measured.

    Fed the step times (:meth:`stepped`) and the write cost of each checkpoint
    (:meth:`written`), it answers the interval in steps for an MTBF (:meth:`steps`).
    Until a first checkpoint was written its cost is unknown and the interval is
    ``min_steps``: the first checkpoint comes early and measures it. ``clock`` is a
    monotonic clock (step times).
    """

    def __init__(self, *, min_steps: int = AUTO_MIN_STEPS, max_steps: int = AUTO_MAX_STEPS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 1 <= min_steps <= max_steps:
            raise ValueError(f"need 1 <= min_steps <= max_steps, got {min_steps}, {max_steps}")
        self.min_steps, self.max_steps = min_steps, max_steps
        self._clock = clock
        self.step_s = 0.0
        """Moving average of the seconds per step (0: not measured yet)."""
        self.cost_s: float | None = None
        """The last checkpoint's write cost in seconds (None: none written yet)."""
        self._last_step_at: float | None = None

    def stepped(self) -> None:
        """A step ended now."""
        now = self._clock()
        if self._last_step_at is not None:
            took = now - self._last_step_at
            self.step_s = took if not self.step_s else (
                STEP_TIME_WEIGHT * took + (1 - STEP_TIME_WEIGHT) * self.step_s)
        self._last_step_at = now

    def paused(self) -> None:
        """Steps stopped for something else (a world forming): the gap is no step time."""
        self._last_step_at = None

    def written(self, cost_s: float) -> None:
        """A checkpoint was written, at a cost of ``cost_s`` seconds."""
        self.cost_s = max(cost_s, 0.0)

    def steps(self, mtbf_s: float) -> int:
        """The interval in steps for a mean time between whole-job restarts of ``mtbf_s``."""
        if self.cost_s is None:
            return self.min_steps
        return auto_interval_steps(mtbf_s=mtbf_s, cost_s=self.cost_s,
                                   step_s=self.step_s, min_steps=self.min_steps,
                                   max_steps=self.max_steps)


class TerminationSignal:
    """Turns SIGTERM into a flag for the training loop, and tracks the grace period.

    ``grace_seconds`` is the pod's terminationGracePeriodSeconds: the time between
    SIGTERM and SIGKILL. :meth:`remaining` answers how much of it is left, less
    ``margin_seconds`` for the process to exit. ``callback`` runs inside the handler
    with the signal number (e.g. to tell a watcher thread to stop); like the handler it
    must be quick. It may raise to interrupt what the main thread is blocked in (the
    elastic runtime does so while a member waits for a world or its peers); the flag is
    set before it runs. A second signal changes nothing.
    """

    def __init__(
        self,
        grace_seconds: float = KUBERNETES_DEFAULT_GRACE_SECONDS,
        *,
        margin_seconds: float = 1.0,
        signals: Sequence[signal.Signals] = (signal.SIGTERM,),
        callback: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if grace_seconds <= 0 or margin_seconds < 0:
            raise ValueError(
                f"grace_seconds must be > 0 and margin_seconds >= 0, got {grace_seconds},"
                f" {margin_seconds}"
            )
        self.grace_seconds = grace_seconds
        self.margin_seconds = margin_seconds
        self._signals = tuple(signals)
        self._callback = callback
        self._clock = clock
        self._received: int | None = None
        self._received_at = 0.0
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> TerminationSignal:
        """Install the handler (main thread only); returns self for chaining."""
        if self._previous:
            raise RuntimeError("TerminationSignal is already installed")
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "TerminationSignal.install() must run on the main thread: Python delivers"
                " signals only there"
            )
        for signum in self._signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        """Put back the handlers that were there before :meth:`install`."""
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    def __enter__(self) -> TerminationSignal:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.trigger(signum)

    def trigger(self, signum: int = signal.SIGTERM) -> None:
        """Do what the handler does: for a stop that does not come as a signal."""
        if self._received is not None:
            return
        self._received = signum
        self._received_at = self._clock()
        if self._callback is not None:
            self._callback(signum)

    @property
    def requested(self) -> bool:
        """Whether a termination signal has arrived."""
        return self._received is not None

    @property
    def signum(self) -> int | None:
        """The signal that arrived first, if any."""
        return self._received

    def remaining(self) -> float:
        """Seconds left to save and flush before SIGKILL, less the exit margin (>= 0)."""
        budget = self.grace_seconds - self.margin_seconds
        if self._received is not None:
            budget -= self._clock() - self._received_at
        return max(0.0, budget)
