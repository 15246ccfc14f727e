"""Training state that survives membership changes: commit, restore, sync.

:class:`State` wraps a model, its optimizer, an elastic sampler, the global step, any
named object with ``state_dict``/``load_state_dict`` (LR schedulers, a
``torch.amp.GradScaler``, EMA weights, a data-loader position), the random-number
generators and extra plain values. ``commit()`` snapshots all of it into host memory
(and hands it to the checkpointer when one is due); ``restore()`` rolls back to that
snapshot after a failure; ``sync(src)`` makes every member of a new world adopt
``src``'s state by tensor broadcast, so newcomers need no disk.

The same dictionary, :meth:`State.to_payload`, is what a checkpointer writes and what
:meth:`State.load_payload` reads back.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from ringwright.world import World

from .checkpoint.guard import Checkpointer, CheckpointGuard
from .checkpoint.policy import AutoInterval, CheckpointPolicy, RestartHistory
from .collectives.backend import CollectiveBackend
from .collectives.buckets import BucketSettings, GradientBuckets
from .kvlog import log_event, runtime_logger
from .lr_scaling import LRScaler
from .rng import RNGMode, RNGState, derived_seed
from .sampler import ElasticSampler
from .state_sync import broadcast_payload

__all__ = ["PAYLOAD_FORMAT", "Checkpointer", "State", "StateBinding", "Stateful",
           "StopSignal", "Terminated"]

_log = runtime_logger("state")

PAYLOAD_FORMAT = 2
"""2: LR scaling no longer lives in the optimizer's groups; named objects and RNG states."""


class Stateful(Protocol):
    """Anything that can join the state by name: schedulers, GradScaler, EMA, counters."""

    def state_dict(self) -> Any:
        """A snapshot of the object (tensors and plain values)."""
        ...

    def load_state_dict(self, state_dict: Any, /) -> Any:
        """Adopt a snapshot made by :meth:`state_dict`."""
        ...


class StopSignal(Protocol):
    """A termination request (SIGTERM) and the grace period left to act on it."""

    @property
    def requested(self) -> bool:
        """Whether the signal arrived."""
        ...

    @property
    def signum(self) -> int | None:
        """Which signal arrived."""
        ...

    def remaining(self) -> float:
        """Seconds of the grace period left for a final checkpoint."""
        ...


class Terminated(SystemExit):
    """Training stopped on a termination signal, after the final checkpoint.

    Exits the process with the shell's status for that signal (143 for SIGTERM).
    """

    def __init__(self, signum: int, step: int, flushed: bool) -> None:
        super().__init__(128 + signum)
        self.signum, self.step, self.flushed = signum, step, flushed


class StateBinding(Protocol):
    """What a state needs from the group it trains in (the group manager provides it)."""

    @property
    def backend(self) -> CollectiveBackend:
        """The collectives of the current world."""
        ...

    @property
    def rank(self) -> int:
        """This member's rank in the current world."""
        ...

    @property
    def world(self) -> World:
        """The current world."""
        ...

    def check_world(self) -> None:
        """Raise :class:`~ringwright.runtime.collectives.group.WorldChanged` on every rank
        alike when a newer world has been published."""
        ...

    def progress(self) -> None:
        """Tell the stall watchdog that the training loop advanced."""
        ...

    def busy(self) -> contextlib.AbstractContextManager[None]:
        """Pause the stall watchdog for work that makes no steps (heartbeats go on)."""
        ...


def is_stateful(value: object) -> bool:
    """Whether ``value`` can join the state as an object (has both state-dict methods)."""
    return callable(getattr(value, "state_dict", None)) and \
        callable(getattr(value, "load_state_dict", None))


class State:
    """Model, optimizer, sampler, step, named objects, RNG and extras, kept consistent
    across a job's world.

    Keyword arguments besides the options below register objects with
    ``state_dict``/``load_state_dict`` (schedulers, a GradScaler, EMA weights) by name
    in :attr:`objects`; any other keyword is refused (a mistyped option must not vanish
    into the state). Plain values to keep with the state (a best loss, a counter) go in
    ``extra``, a mapping, and live on in :attr:`extra`. ``rng`` chooses how
    random-number generators behave across ranks
    (:class:`~ringwright.runtime.rng.RNGMode`: ``shared`` or ``per_rank``; ``seed``
    feeds the per-rank streams). ``checkpointer`` and ``checkpoint_policy`` override what
    the job's ``spec.checkpoint`` asks for.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sampler: ElasticSampler,
        *,
        checkpointer: Checkpointer | None = None,
        checkpoint_policy: CheckpointPolicy | None = None,
        rng: RNGMode | str = RNGMode.SHARED,
        seed: int = 0,
        buckets: BucketSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        extra: Mapping[str, Any] | None = None,
        **objects: Stateful,
    ) -> None:
        _check_registrations(objects, extra or {})
        self.model = model
        self.optimizer = optimizer
        self.sampler = sampler
        self.step = 0
        """Global optimizer steps completed (identical on every rank)."""
        self.objects: dict[str, Stateful] = dict(objects)
        """Named objects whose state_dict joins the state."""
        self.extra: dict[str, Any] = dict(extra or {})
        """User values to keep with the state (plain values, small)."""
        self.rng_mode = RNGMode(rng)
        self.seed = seed
        self.lr = LRScaler(optimizer)
        self.checkpoint_policy = checkpoint_policy
        """When to checkpoint; None follows the job's intervals (``spec.checkpoint``)."""
        self.synced_generation = -1
        """World generation whose group this state was last synced in; -1 holds no state."""
        self.synced_rank = -1
        """This member's rank in that world."""
        self.synced_members: tuple[str, ...] = ()
        """The pods of that world, in rank order: every one holds the same commit."""
        self.sync_bytes = 0
        """Bytes the last sync moved (0 when every member already held the commit)."""
        self.stop: StopSignal | None = None
        """Set by the elastic runtime: checked after every step."""
        self._clock = clock
        self._wall = wall_clock
        self.history = RestartHistory(wall_clock())
        """When the job first started and how often it restarted whole since: kept with
        the state (so in checkpoints), counted up by :meth:`restore_checkpoint`."""
        self.auto_interval: AutoInterval | None = None
        """Under ``intervalSteps: Auto``: the measured step time and write cost."""
        self._rng = RNGState()
        self._checkpoints: CheckpointGuard | None = None
        if checkpointer is not None:
            self.use_checkpointer(checkpointer)
        self._committed: dict[str, Any] | None = None
        self._commit_stale = True
        self._binding: StateBinding | None = None
        self._last_checkpoint = (0, clock())
        self._buckets = (GradientBuckets(model.parameters(), lambda: self.binding.backend,
                                         buckets) if buckets is not None else None)
        """With bucket settings, gradients are all-reduced during backward."""

    @property
    def device(self) -> torch.device:
        """Where the model lives; decides the collective library."""
        for p in self.model.parameters():
            return p.device
        return torch.device("cpu")

    @property
    def binding(self) -> StateBinding:
        """The group this state trains in; set by the elastic runtime."""
        if self._binding is None:
            raise RuntimeError("state is not bound to a group: call it from ringwright's run()")
        return self._binding

    @property
    def rank(self) -> int:
        """This process's rank in the current world (0 .. world_size-1); it can change
        when the world does, so read it where it is used rather than keep it."""
        return self.binding.rank

    @property
    def world_size(self) -> int:
        """How many workers the current world has; changes with the world."""
        return self.binding.world.size

    @property
    def local_rank(self) -> int:
        """This process's index among the training processes of its pod: ``LOCAL_RANK``
        when set (as torchrun sets it), else 0, since ringwright runs one per pod."""
        value = os.environ.get("LOCAL_RANK", "")
        if not value:
            return 0
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"LOCAL_RANK={value!r} is not an integer") from None

    def busy(self) -> contextlib.AbstractContextManager[None]:
        """A block that makes no steps for a while and is not a stall: a long
        evaluation, a ``torch.compile`` warm-up, a large data load.

        ::

            with state.busy():
                evaluate(model)

        The stall watchdog (``spec.faultTolerance.stallTimeoutSeconds``) is paused
        inside and starts its timeout again on leaving. Heartbeats go on from their own
        thread, so a member that dies inside is still found dead. Outside ``run()``
        there is no watchdog and the block just runs.
        """
        if self._binding is None:
            return contextlib.nullcontext()
        return self._binding.busy()

    def bind(self, binding: StateBinding) -> None:
        """Attach to the group manager (done once by the elastic runtime)."""
        self._binding = binding

    def track(self, name: str, obj: Stateful) -> None:
        """Add ``obj`` to the state under ``name`` (committed, synced, checkpointed)."""
        if name in self.extra or not is_stateful(obj):
            raise ValueError(f"{name!r}: needs a new name and state_dict/load_state_dict")
        self.objects[name] = obj

    @property
    def checkpointer(self) -> Checkpointer | None:
        """Where checkpoints go: the script's own, or one built from ``spec.checkpoint``."""
        return self._checkpoints.checkpointer if self._checkpoints is not None else None

    @property
    def checkpoints(self) -> CheckpointGuard | None:
        """The checkpointer behind its error handling (reports, backoff)."""
        return self._checkpoints

    def use_checkpointer(self, checkpointer: Checkpointer, *, where: str = "") -> None:
        """Checkpoint through ``checkpointer``; ``where`` names its location in messages."""
        self._checkpoints = CheckpointGuard(checkpointer, clock=self._clock, where=where)

    # The training loop's calls.

    def allreduce_gradients(self, *, average: bool = True) -> None:
        """Average (or sum) gradients over the world, after ``backward()``.

        With bucket settings this waits for the buckets that backward launched; a
        parameter without a gradient on every rank then keeps ``grad=None``.
        """
        if self._buckets is not None:
            self._buckets.finish(average_over=self.binding.world.size if average else None)
            return
        self.binding.backend.allreduce_gradients(self.model.parameters(), average=average)

    def advance(self) -> None:
        """Record a completed step: move the sampler, count the step, follow the LR ramp."""
        self.sampler.advance()
        self.step += 1
        self.lr.step = self.step
        if self.auto_interval is not None:
            self.auto_interval.stepped()
        self.binding.progress()
        self.stop_if_signalled(committed=False)

    def commit(self) -> None:
        """Snapshot the state; checkpoint when due; switch worlds if a new one is out.

        Raises :class:`~ringwright.runtime.collectives.group.WorldChanged` (on every rank alike)
        after the snapshot when a newer world has been published.
        """
        self._committed = self.to_payload()
        self._maybe_checkpoint()
        self.binding.progress()
        self.binding.check_world()

    def restore(self) -> None:
        """Roll back to the last commit."""
        if self._committed is None:
            raise RuntimeError("nothing committed yet: restore() needs a prior commit()")
        if self._buckets is not None:
            self._buckets.discard()
        self.load_payload(self._committed)
        self._reseed_per_rank()

    # Called by the elastic runtime around a world change.

    def sync(self, src: int, *, skip: bool = False) -> None:
        """Adopt rank ``src``'s state: the tensors by tensor broadcast, the small rest as
        one pickled skeleton. ``skip`` when every member already holds the same commit:
        nothing moves."""
        if skip:
            self.sync_bytes = 0
            return
        rank = self.binding.rank
        mine = self._payload() if rank == src else None
        received, self.sync_bytes = broadcast_payload(self.binding.backend, mine, src, rank)
        if rank != src:
            self._load(received, copy=False)
        self._commit_stale = True

    def follow_world(self, world: World, rank: int) -> None:
        """Re-partition the data and rescale the LR for ``world``, then commit locally."""
        self.sampler.set_world(rank, world.size)
        self.lr.set_world(world.lr, world.size, self.step)
        self.synced_generation, self.synced_rank = world.generation, rank
        self.synced_members = world.pods
        self._follow_auto_interval(world)
        self._reseed_per_rank()
        if self._committed is None or self._commit_stale:
            self._committed = self.to_payload()
        else:
            # The state is the commit it was synced from: only the LR ramp moved, so
            # the (possibly large) snapshot is kept rather than taken again.
            self._committed["lr"] = self.lr.state_dict()
        self._commit_stale = False

    def restore_checkpoint(self) -> bool:
        """Load the newest checkpoint, if there is a checkpointer and a good checkpoint."""
        if self._checkpoints is None:
            return False
        found = self._checkpoints.restore_latest()
        if found is None:
            return False
        self.load_payload(found.payload)
        self.history = self.history.restarted()
        self._commit_stale = True
        self._last_checkpoint = (self.step, self._clock())
        return True

    @property
    def checkpointed_step(self) -> int:
        """The step of the newest checkpoint this process started writing or restored."""
        return self._last_checkpoint[0]

    def save_checkpoint(self, *, writer: bool | None = None) -> bool:
        """Checkpoint the last commit now; True when a write started.

        Only the member that was rank 0 of the world its state was synced in writes:
        every member holds the same state, and exactly one such member exists.
        ``writer`` overrides that choice (that member may be the one that died).
        """
        guard = self._checkpoints
        if writer is None:
            writer = self.synced_rank == 0
        if guard is None or not writer or self._committed is None:
            return False
        step = int(self._committed["step"])
        size = self._binding.world.size if self._binding is not None else 1
        meta = {"epoch": self.sampler.epoch, "world_size": size}
        # The committed snapshot is a private host copy that is replaced, never
        # modified, so the writer may read it where it is.
        started = guard.save(step, self._committed, meta)
        self._last_checkpoint = (step, self._clock())
        return started

    def stop_if_signalled(self, *, committed: bool) -> None:
        """On a termination signal, write a final checkpoint and raise :class:`Terminated`.

        ``committed=False`` (between steps, where every rank holds the same state)
        saves the current step; ``committed=True`` (after a failed collective, or while
        a world forms) saves the last commit. Rank 0 writes and waits for the write
        within the grace period.
        """
        stop = self.stop
        if stop is None or not stop.requested:
            return
        if not committed:
            self._committed = self.to_payload()
        flushed = True
        if self._checkpoints is not None and self.save_checkpoint():
            flushed = self._checkpoints.flush(timeout=max(stop.remaining(), 0.0))
        raise Terminated(stop.signum or signal.SIGTERM, self.step, flushed)

    # The payload shared with checkpointers.

    def to_payload(self) -> dict[str, Any]:
        """Everything to persist, as host-memory copies independent of the live state."""
        payload: dict[str, Any] = _to_host(self._payload())
        return payload

    def load_payload(self, payload: dict[str, Any]) -> None:
        """Adopt a payload made by :meth:`to_payload` (here or on another member)."""
        fmt = payload.get("format")
        if fmt not in (1, PAYLOAD_FORMAT):
            raise ValueError(f"state payload format {fmt!r}, expected {PAYLOAD_FORMAT}")
        self._load(payload, copy=True)
        if fmt == 1:
            # Format 1 stored the rescaled rates in the groups and the user's beside them.
            for group, lr in zip(self.optimizer.param_groups, payload["lr"]["base_lrs"],
                                 strict=True):
                group["lr"] = float(lr)

    def _payload(self) -> dict[str, Any]:
        """The live state as one dictionary; its tensors are the live ones, not copies."""
        payload: dict[str, Any] = {
            "format": PAYLOAD_FORMAT,
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "sampler": self.sampler.state_dict(),
            "lr": self.lr.state_dict(),
            "objects": {name: obj.state_dict() for name, obj in self.objects.items()},
            "extra": self.extra,
            "history": self.history.to_dict(),
        }
        if self.rng_mode is RNGMode.SHARED:
            payload["rng"] = self._rng.state_dict()
        return payload

    def _load(self, payload: dict[str, Any], *, copy: bool) -> None:
        """Adopt ``payload``; ``copy=False`` when nothing else references its tensors."""
        fresh: Callable[[Any], Any] = _to_host if copy else _same
        self.model.load_state_dict(payload["model"])
        # The optimizer keeps tensors it is given when dtype and device already match
        # and then updates them in place: hand it copies, or the next step would
        # silently rewrite the committed snapshot.
        self.optimizer.load_state_dict(fresh(payload["optimizer"]))
        self.sampler.load_state_dict(payload["sampler"])
        self.lr.load_state_dict(payload["lr"])
        saved = payload.get("objects", {})
        for name, obj in self.objects.items():
            if name in saved:
                obj.load_state_dict(fresh(saved[name]))
            else:
                log_event(_log, logging.WARNING, "state_object_not_saved", name=name,
                          step=payload["step"], kept="its current state")
        if self.rng_mode is RNGMode.SHARED and "rng" in payload:
            self._rng.load_state_dict(payload["rng"])
        self.extra = _to_host(payload["extra"])
        self.history = RestartHistory.from_dict(payload.get("history"), self._wall())
        self.step = int(payload["step"])
        self.lr.step = self.step

    def _reseed_per_rank(self) -> None:
        if self.rng_mode is RNGMode.PER_RANK and self._binding is not None:
            world = self._binding.world
            self._rng.seed(derived_seed(self.seed, self.step, self.synced_rank, world.size))

    def mtbf_seconds(self) -> float:
        """The observed mean time between whole-job restarts, now (see
        :meth:`~ringwright.runtime.checkpoint.policy.RestartHistory.mtbf`)."""
        return self.history.mtbf(self._wall())

    def checkpoint_interval_steps(self) -> int:
        """The step interval checkpoints follow now: the chosen one under
        ``intervalSteps: Auto``, else the job's (or the script's policy's)."""
        if self.checkpoint_policy is not None:
            return self.checkpoint_policy.interval_steps
        if self.auto_interval is not None:
            return self.auto_interval.steps(self.mtbf_seconds())
        return self.binding.world.checkpoint.interval_steps

    def _follow_auto_interval(self, world: World) -> None:
        """Start (or stop) measuring for ``intervalSteps: Auto`` as ``world`` asks; a
        world change is a pause, not a step."""
        settings = world.checkpoint
        if not settings.interval_auto:
            self.auto_interval = None
            return
        if self.auto_interval is None or (
                (self.auto_interval.min_steps, self.auto_interval.max_steps)
                != (settings.auto_min_steps, settings.auto_max_steps)):
            measured = self.auto_interval
            self.auto_interval = AutoInterval(min_steps=settings.auto_min_steps,
                                              max_steps=settings.auto_max_steps,
                                              clock=self._clock)
            if measured is not None:
                self.auto_interval.step_s, self.auto_interval.cost_s = \
                    measured.step_s, measured.cost_s
        self.auto_interval.paused()

    def _maybe_checkpoint(self) -> None:
        guard = self._checkpoints
        if guard is None or self.synced_rank != 0:
            return
        last_step, last_time = self._last_checkpoint
        policy = self.checkpoint_policy or CheckpointPolicy.from_settings(
            self.binding.world.checkpoint)
        auto = self.auto_interval
        if self.checkpoint_policy is None and auto is not None:
            guard.poll()
            if guard.last_write_s is not None:
                auto.written(guard.last_write_s)
            policy = CheckpointPolicy(self.checkpoint_interval_steps(), policy.interval_seconds)
        if policy.due(step=self.step, now=self._clock(), last_step=last_step,
                      last_time=last_time) and guard.may_write():
            self.save_checkpoint()


def _check_registrations(objects: Mapping[str, object], extra: Mapping[str, object]) -> None:
    """Refuse what :class:`State` cannot keep as asked, saying what it accepts."""
    for name, value in objects.items():
        if not is_stateful(value):
            options = [p.name for p in inspect.signature(State).parameters.values()
                       if p.kind is inspect.Parameter.KEYWORD_ONLY]
            shown = repr(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise TypeError(
                f"State() got {name}={shown}, which is neither one of its options "
                f"({', '.join(options)}) nor an object with state_dict() and "
                "load_state_dict(). Keyword arguments register such objects (schedulers, "
                "a GradScaler, EMA weights) by name; keep a plain value or tensor with "
                f"extra={{{name!r}: ...}}")
    for name, value in extra.items():
        if is_stateful(value):
            raise TypeError(f"State(extra=...) got {name!r}, an object with state_dict(): "
                            f"pass it as State(..., {name}=...) so that its state_dict joins")
    both = sorted(objects.keys() & extra.keys())
    if both:
        raise ValueError(f"State() got {', '.join(both)} both as an object and in extra")


def _same(obj: Any) -> Any:
    return obj


def _to_host(obj: Any) -> Any:
    """A deep copy with every tensor cloned into host memory."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_host(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_host(v) for v in obj)
    return obj
