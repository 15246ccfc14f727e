"""Runtime metrics (Prometheus) of one training process.

The elastic runtime feeds them from a few seams, so training code and the group
manager stay unaware of them:

- :class:`MeteredBackend` wraps the collective backend and times every collective;
- :class:`StepMeter` wraps the state's binding to the group manager, whose
  ``progress()`` the state calls after every step, and times the steps;
- the runtime reports rollbacks and each new world (:meth:`RuntimeMetrics.rolled_back`,
  :meth:`RuntimeMetrics.world_ready`), which makes a failure plus the next world a
  recovery;
- a :class:`~ringwright.runtime.checkpoint.checkpointer.Checkpointer` listener reports each write;
- the default backends' liveness judge tells the heartbeat lag
  (:attr:`RuntimeMetrics.heartbeat_lag`'s ``set`` is its lag listener).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ringwright.world import World

from .checkpoint.checkpointer import CheckpointWritten
from .collectives.backend import CollectiveBackend, CollectiveError, PeerFailureListener
from .state import State, StateBinding

T = TypeVar("T")

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0)
RECOVERY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
CHECKPOINT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                      60.0, 300.0)


class RuntimeMetrics:
    """One training process's metrics, in a registry of their own."""

    def __init__(self, registry: CollectorRegistry | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry or CollectorRegistry()
        self._clock = clock
        self._lock = threading.Lock()
        self._failure: tuple[str, float] | None = None
        self._last: tuple[int, int, float] | None = None
        """(step, samples seen, time) of the last step observed in this world."""
        r = self.registry
        p = "ringwright_runtime_"
        self.step = Gauge(f"{p}step", "Global optimizer steps completed.", registry=r)
        self.step_seconds = Histogram(f"{p}step_seconds", "Wall time of one training step.",
                                      buckets=STEP_BUCKETS, registry=r)
        self.samples = Counter(f"{p}samples", "Samples trained on by the whole world (as "
                               "seen by this member; rolled-back steps count again).",
                               registry=r)
        self.samples_per_second = Gauge(f"{p}samples_per_second",
                                        "Global samples per second over the last step.",
                                        registry=r)
        self.world_size = Gauge(f"{p}world_size", "Members of the current world.", registry=r)
        self.world_generation = Gauge(f"{p}world_generation", "Generation of the current world.",
                                      registry=r)
        self.rank = Gauge(f"{p}rank", "This member's rank in the current world.", registry=r)
        self.rollbacks = Counter(f"{p}rollbacks", "Rollbacks to the last commit.", registry=r)
        self.steps_lost = Counter(f"{p}steps_lost", "Steps undone by rollbacks.", registry=r)
        self.recoveries = Counter(f"{p}recoveries", "Failures recovered from, by cause.",
                                  ["cause"], registry=r)
        self.recovery_seconds = Histogram(
            f"{p}recovery_seconds", "From noticing a failure to training again in the next "
            "world, by cause.", ["cause"], buckets=RECOVERY_BUCKETS, registry=r)
        self.collective_seconds = Histogram(
            f"{p}collective_seconds", "Time in collectives, by operation.", ["op"],
            buckets=STEP_BUCKETS, registry=r)
        self.checkpoint_stall_seconds = Histogram(
            f"{p}checkpoint_stall_seconds", "Training paused to snapshot a checkpoint.",
            buckets=CHECKPOINT_BUCKETS, registry=r)
        self.checkpoint_write_seconds = Histogram(
            f"{p}checkpoint_write_seconds", "Background write of a checkpoint.",
            buckets=CHECKPOINT_BUCKETS, registry=r)
        self.checkpoint_bytes = Counter(f"{p}checkpoint_bytes", "Checkpoint bytes written.",
                                        registry=r)
        self.heartbeat_lag = Gauge(
            "ringwright_runtime_heartbeat_lag_seconds", "Time since the stalest peer of this "
            "member's generation last heartbeat, as this member's liveness judge last saw it.",
            registry=r)
        self.lr_factor = Gauge(f"{p}lr_factor", "Learning-rate multiplier for the world size "
                               "(and warmup).", registry=r)

    # -- what the runtime reports ------------------------------------------------------

    def step_done(self, step: int, samples_seen: int, lr_factor: float) -> None:
        """A step completed; ``samples_seen`` counts samples since training began."""
        now = self._clock()
        self.step.set(step)
        self.lr_factor.set(lr_factor)
        with self._lock:
            last = self._last
            if last is not None and step == last[0]:
                return  # a commit: the step's time runs on to the next step
            self._last = (step, samples_seen, now)
        if last is None or step < last[0]:
            return
        elapsed = now - last[2]
        samples = max(samples_seen - last[1], 0)
        self.step_seconds.observe(elapsed / (step - last[0]))
        self.samples.inc(samples)
        if elapsed > 0:
            self.samples_per_second.set(samples / elapsed)

    def rolled_back(self, cause: str, steps_lost: int) -> None:
        """A failure (``cause``) made this member roll back ``steps_lost`` steps."""
        self.rollbacks.inc()
        self.steps_lost.inc(max(steps_lost, 0))
        with self._lock:
            if self._failure is None:
                self._failure = (cause, self._clock())

    def world_ready(self, world: World, rank: int, lr_factor: float) -> None:
        """Training resumes in ``world``; completes a recovery when a failure preceded it."""
        now = self._clock()
        with self._lock:
            failure, self._failure = self._failure, None
            # Steps are timed within one world: the pause in between is not a step.
            self._last = None
        self.world_size.set(world.size)
        self.world_generation.set(world.generation)
        self.rank.set(rank)
        self.lr_factor.set(lr_factor)
        if failure is not None:
            cause, since = failure
            self.recoveries.labels(cause).inc()
            self.recovery_seconds.labels(cause).observe(now - since)

    def checkpoint_written(self, written: CheckpointWritten) -> None:
        """A checkpoint listener: one background write finished."""
        self.checkpoint_stall_seconds.observe(written.stall_s)
        self.checkpoint_write_seconds.observe(written.write_s)
        self.checkpoint_bytes.inc(written.nbytes)


def samples_seen(state: State) -> int:
    """Samples consumed since training began, from the sampler's position."""
    sampler = state.sampler
    return sampler.epoch * sampler.num_samples + sampler.offset


class StepMeter:
    """The state's binding to its group, passing through, timing each step it sees."""

    def __init__(self, inner: StateBinding, state: State, metrics: RuntimeMetrics,
                 on_progress: Callable[[State], None] | None = None) -> None:
        self._inner, self._state, self._metrics = inner, state, metrics
        self._on_progress = on_progress

    @property
    def backend(self) -> CollectiveBackend:
        """The collectives of the current world."""
        return self._inner.backend

    @property
    def rank(self) -> int:
        """This member's rank in the current world."""
        return self._inner.rank

    @property
    def world(self) -> World:
        """The current world."""
        return self._inner.world

    def check_world(self) -> None:
        """As the group manager's (may raise WorldChanged)."""
        self._inner.check_world()

    def progress(self) -> None:
        """The loop advanced: a step (or a commit, which leaves the step unchanged)."""
        self._inner.progress()
        state = self._state
        self._metrics.step_done(state.step, samples_seen(state), state.lr.factor(state.step))
        if self._on_progress is not None:
            self._on_progress(state)

    def busy(self) -> contextlib.AbstractContextManager[None]:
        """As the group manager's (pauses the stall watchdog)."""
        return self._inner.busy()


class MeteredBackend:
    """A collective backend that times every collective of the one it wraps."""

    def __init__(self, inner: CollectiveBackend, metrics: RuntimeMetrics,
                 on_gradient_wait: Callable[[float], None] | None = None) -> None:
        self._inner = inner
        self._seconds = metrics.collective_seconds
        self._on_wait = on_gradient_wait
        """Told the seconds of every gradient all-reduce (the wait for slower peers)."""

    @property
    def name(self) -> str:
        """The wrapped backend's name."""
        return self._inner.name

    @property
    def device(self) -> torch.device:
        """The wrapped backend's device."""
        return self._inner.device

    def init(self, world: World, rank: int, superseded: Callable[[], bool],
             on_peer_failure: PeerFailureListener) -> None:
        """Form the group (timed as ``init``)."""
        with self._seconds.labels("init").time():
            self._inner.init(world, rank, superseded, on_peer_failure)

    def abort(self, reason: str) -> None:
        """Abort the wrapped backend's group."""
        self._inner.abort(reason)

    def failure_of(self, err: BaseException) -> CollectiveError | None:
        """The wrapped backend's reading of ``err``."""
        return self._inner.failure_of(err)

    def shutdown(self, *, left_cleanly: bool = False) -> None:
        """Leave the current group."""
        self._inner.shutdown(left_cleanly=left_cleanly)

    def close(self) -> None:
        """Leave for good."""
        self._inner.close()

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], src: int) -> None:
        """Timed ``broadcast_tensors``."""
        with self._seconds.labels("broadcast_tensors").time():
            self._inner.broadcast_tensors(tensors, src)

    def broadcast_object(self, obj: T, src: int) -> T:
        """Timed ``broadcast_object``."""
        with self._seconds.labels("broadcast_object").time():
            return self._inner.broadcast_object(obj, src)

    def allgather_object(self, obj: T) -> list[T]:
        """Timed ``allgather_object``."""
        with self._seconds.labels("allgather_object").time():
            return self._inner.allgather_object(obj)

    def allreduce_gradients(self, params: Iterable[torch.Tensor], *, average: bool) -> None:
        """Timed ``allreduce_gradients``."""
        with self._seconds.labels("allreduce_gradients").time(), self._waiting():
            self._inner.allreduce_gradients(params, average=average)

    def allreduce_(self, flat: torch.Tensor, name: str) -> None:
        """Timed ``allreduce_`` (one bucket)."""
        with self._seconds.labels("allreduce_bucket").time(), self._waiting():
            self._inner.allreduce_(flat, name)

    def allreduce_max(self, value: int) -> int:
        """Timed ``allreduce_max``."""
        with self._seconds.labels("allreduce_max").time():
            return self._inner.allreduce_max(value)

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        if self._on_wait is None:
            yield
            return
        start = time.monotonic()
        try:
            yield
        finally:
            self._on_wait(time.monotonic() - start)

    def barrier(self) -> None:
        """Timed ``barrier``."""
        with self._seconds.labels("barrier").time():
            self._inner.barrier()
