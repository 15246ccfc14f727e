"""Where one member's time goes: step times for the straggler policy, time per phase for
the job's goodput. Fed by the elastic runtime's seams (steps, the gradient all-reduce,
failures, world formation), read as :class:`~ringwright.world.MemberStats`.

Step times are kept per world generation as medians over the last
:data:`STEP_WINDOW` steps: a one-off pause is one slow step among many and moves the
median by nothing, while a member slow for good moves it within a window.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable

from ringwright.world import MemberStats, Phase

STEP_WINDOW = 32
"""Steps behind the step-time medians."""


class TimeKeeper:
    """Splits this member's time into :class:`~ringwright.world.Phase` s and times its steps.

    The time from start-up to the first world counts as re-forming. Thread-safe: the
    all-reduce timing may come from a backend's own thread.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._clock, self._wall = clock, wall_clock
        self.started_at = wall_clock()
        self._lock = threading.Lock()
        self.seconds: dict[Phase, float] = dict.fromkeys(Phase, 0.0)
        """Seconds per phase so far (the current phase's running part not included)."""
        self.phase = Phase.REFORMING
        self._since = clock()
        self.generation = 0
        self.step = 0
        self._replay_until = 0
        self._step_at: float | None = None
        self._waited = 0.0
        self._steps: deque[float] = deque(maxlen=STEP_WINDOW)
        self._computes: deque[float] = deque(maxlen=STEP_WINDOW)

    def _enter(self, phase: Phase, now: float) -> None:
        self.seconds[self.phase] += max(now - self._since, 0.0)
        self.phase, self._since = phase, now

    def forming(self) -> None:
        """The member waits for a world and forms its group."""
        with self._lock:
            self._enter(Phase.REFORMING, self._clock())
            self._step_at = None

    def syncing(self) -> None:
        """The member brings its state in line with the world's."""
        with self._lock:
            self._enter(Phase.SYNCING, self._clock())

    def world_ready(self, generation: int, step: int) -> None:
        """Training (or replaying) starts in world ``generation`` at ``step``; step times
        start over, as a new world's members and speed are new."""
        with self._lock:
            now = self._clock()
            self._enter(self._training_phase(step), now)
            if generation != self.generation:
                self._steps.clear()
                self._computes.clear()
            self.generation, self.step = generation, step
            self._step_at, self._waited = now, 0.0

    def waited(self, seconds: float) -> None:
        """The member spent ``seconds`` in the gradient all-reduce (waiting for peers)."""
        with self._lock:
            self._waited += max(seconds, 0.0)

    def stepped(self, step: int) -> None:
        """The training loop reached ``step`` (a commit repeats the step: ignored)."""
        with self._lock:
            if step == self.step:
                return
            now = self._clock()
            if self._step_at is not None and step == self.step + 1:
                took = now - self._step_at
                self._steps.append(took)
                self._computes.append(max(took - self._waited, 0.0))
            self._enter(self._training_phase(step), now)
            self.step, self._step_at, self._waited = step, now, 0.0

    def failed(self, rolled_back_from: int, rolled_back_to: int) -> None:
        """A collective failed: the time since the last step went to finding out; the
        steps after ``rolled_back_to`` up to ``rolled_back_from`` will be run again."""
        with self._lock:
            now = self._clock()
            self.phase = Phase.DETECTING
            self._enter(Phase.REFORMING, now)
            self._replay_until = max(self._replay_until, rolled_back_from)
            self.step, self._step_at = rolled_back_to, None

    def _training_phase(self, step: int) -> Phase:
        """The phase of the step that ends at ``step + 1``."""
        return Phase.REPLAYING if step < self._replay_until else Phase.TRAINING

    def stats(self, **extra: float | int | None) -> MemberStats:
        """What this member measured so far, with ``extra`` fields of
        :class:`~ringwright.world.MemberStats` (the checkpoint's)."""
        with self._lock:
            now = self._clock()
            seconds = dict(self.seconds)
            seconds[self.phase] += max(now - self._since, 0.0)
            steps, computes = list(self._steps), list(self._computes)
            generation, step = self.generation, self.step
        return MemberStats.model_validate({
            "generation": generation, "at": self._wall(), "since": self.started_at,
            "step": step,
            "stepsTimed": len(steps),
            "stepSeconds": statistics.median(steps) if steps else 0.0,
            "computeSeconds": statistics.median(computes) if computes else 0.0,
            "seconds": {p.value: round(s, 3) for p, s in seconds.items()},
            **{k: v for k, v in extra.items() if v is not None},
        })


FIRST_GAPS = 8
"""The first gap between two sends is the interval over this; each gap doubles until it
reaches the interval."""


class StatsSender:
    """Sends a :class:`TimeKeeper`'s stats through ``send``: at the first step, then at gaps
    that double from ``every_s / FIRST_GAPS`` up to ``every_s``.

    The first send covers start-up alone (mostly re-forming), so a job's goodput would read
    near zero for a whole interval; the short early gaps replace it with a figure that
    covers training within seconds, and the later ones keep the operator's rounds rare.
    """

    def __init__(self, keeper: TimeKeeper, send: Callable[[MemberStats], None],
                 every_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._keeper, self._send, self._every = keeper, send, every_s
        self._clock = clock
        self._last: float | None = None
        self._gap = every_s / FIRST_GAPS

    def maybe_send(self, **extra: float | int | None) -> bool:
        """Send now when the current gap passed since the last send; True when sent."""
        now = self._clock()
        if self._last is not None:
            if now - self._last < self._gap:
                return False
            self._gap = min(self._gap * 2, self._every)
        self._last = now
        self._send(self._keeper.stats(**extra))
        return True
