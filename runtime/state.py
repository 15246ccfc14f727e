"""Training state that survives membership changes: commit, restore, sync.

:class:`State` wraps a model, its optimizer, an elastic sampler, the global step and
any extra picklable values. ``commit()`` snapshots all of it into host memory (and
hands it to a checkpointer when one is due); ``restore()`` rolls back to that
snapshot after a failure; ``sync(src)`` makes every member of a new world adopt
``src``'s state by broadcast, so newcomers need no disk.

The same dictionary, :meth:`State.to_payload`, is what a checkpointer writes and what
:meth:`State.load_payload` reads back.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from ringwright.world import World

from .backend import CollectiveBackend
from .buckets import BucketSettings, GradientBuckets
from .checkpoint_policy import CheckpointPolicy
from .lr_scaling import LRScaler
from .sampler import ElasticSampler

PAYLOAD_FORMAT = 1


class RestoredCheckpoint(Protocol):
    """A checkpoint read back: the payload that :meth:`State.to_payload` produced."""

    @property
    def payload(self) -> dict[str, Any]:
        """The saved payload, tensors in host memory."""
        ...


class Checkpointer(Protocol):
    """Durable snapshots; :class:`ringwright.runtime.checkpoint.Checkpointer` is one."""

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
        """Raise :class:`~ringwright.runtime.group.WorldChanged` on every rank alike when
        a newer world has been published."""
        ...

    def progress(self) -> None:
        """Tell the stall watchdog that the training loop advanced."""
        ...


class State:
    """Model, optimizer, sampler, step and extras, kept consistent across a job's world."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sampler: ElasticSampler,
        *,
        checkpointer: Checkpointer | None = None,
        buckets: BucketSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        **extra: Any,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.sampler = sampler
        self.step = 0
        """Global optimizer steps completed (identical on every rank)."""
        self.extra: dict[str, Any] = dict(extra)
        """User values to keep with the state (picklable, small)."""
        self.lr = LRScaler(optimizer)
        self.checkpointer = checkpointer
        self.synced_epoch = -1
        """World epoch whose group this state was last synced in; -1 holds no state."""
        self.synced_rank = -1
        """This member's rank in that world."""
        self.stop: StopSignal | None = None
        """Set by the elastic runtime: checked after every step."""
        self._clock = clock
        self._committed: dict[str, Any] | None = None
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

    def bind(self, binding: StateBinding) -> None:
        """Attach to the group manager (done once by the elastic runtime)."""
        self._binding = binding

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
        self.lr.apply(self.step)
        self.binding.progress()
        self.stop_if_signalled(committed=False)

    def commit(self) -> None:
        """Snapshot the state; checkpoint when due; switch worlds if a new one is out.

        Raises :class:`~ringwright.runtime.group.WorldChanged` (on every rank alike)
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

    # Called by the elastic runtime around a world change.

    def sync(self, src: int) -> None:
        """Adopt rank ``src``'s state: tensors in place, the rest as one pickled object."""
        backend = self.binding.backend
        backend.broadcast_tensors(list(self.model.state_dict(keep_vars=True).values()), src)
        rest = backend.broadcast_object(self._payload(with_model=False), src)
        self._load(rest, with_model=False)

    def follow_world(self, world: World, rank: int) -> None:
        """Re-partition the data and rescale the LR for ``world``, then commit locally."""
        self.sampler.set_world(rank, world.size)
        self.lr.set_world(world.lr, world.size, self.step)
        self.synced_epoch, self.synced_rank = world.epoch, rank
        self._committed = self.to_payload()

    def restore_checkpoint(self) -> bool:
        """Load the newest checkpoint, if there is a checkpointer and a checkpoint."""
        if self.checkpointer is None:
            return False
        found = self.checkpointer.restore_latest()
        if found is None:
            return False
        self.load_payload(found.payload)
        self._last_checkpoint = (self.step, self._clock())
        return True

    def save_checkpoint(self) -> None:
        """Checkpoint the last commit now; rank 0 only, as every rank holds the same state."""
        if self.checkpointer is None or self.binding.rank != 0 or self._committed is None:
            return
        step = int(self._committed["step"])
        meta = {"epoch": self.sampler.epoch, "world_size": self.binding.world.size}
        # The committed snapshot is a private host copy that is replaced, never
        # modified, so the writer may read it where it is.
        self.checkpointer.save(step, self._committed, meta, copy=False)
        self._last_checkpoint = (step, self._clock())

    def stop_if_signalled(self, *, committed: bool) -> None:
        """On a termination signal, write a final checkpoint and raise :class:`Terminated`.

        ``committed=False`` (between steps, where every rank holds the same state)
        saves the current step; ``committed=True`` (after a failed collective) saves
        the last commit. Rank 0 writes and waits for the write within the grace period.
        """
        stop = self.stop
        if stop is None or not stop.requested:
            return
        if not committed:
            self._committed = self.to_payload()
        flushed = True
        if self.checkpointer is not None and self._binding is not None:
            self.save_checkpoint()
            flushed = self.checkpointer.flush(timeout=max(stop.remaining(), 0.0))
        raise Terminated(stop.signum or signal.SIGTERM, self.step, flushed)

    # The payload shared with checkpointers.

    def to_payload(self) -> dict[str, Any]:
        """Everything to persist, as host-memory copies independent of the live state."""
        return self._payload(with_model=True)

    def load_payload(self, payload: dict[str, Any]) -> None:
        """Adopt a payload made by :meth:`to_payload` (here or on another member)."""
        fmt = payload.get("format")
        if fmt != PAYLOAD_FORMAT:
            raise ValueError(f"state payload format {fmt!r}, expected {PAYLOAD_FORMAT}")
        self._load(payload, with_model=True)

    def _payload(self, *, with_model: bool) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "format": PAYLOAD_FORMAT,
            "step": self.step,
            "optimizer": _to_host(self.optimizer.state_dict()),
            "sampler": self.sampler.state_dict(),
            "lr": self.lr.state_dict(),
            "extra": _to_host(self.extra),
        }
        if with_model:
            payload["model"] = _to_host(self.model.state_dict())
        return payload

    def _load(self, payload: dict[str, Any], *, with_model: bool) -> None:
        if with_model:
            self.model.load_state_dict(payload["model"])
        # The optimizer keeps tensors it is given when dtype and device already match
        # and then updates them in place: hand it copies, or the next step would
        # silently rewrite the committed snapshot.
        self.optimizer.load_state_dict(_to_host(payload["optimizer"]))
        self.sampler.load_state_dict(payload["sampler"])
        self.lr.load_state_dict(payload["lr"])
        self.extra = _to_host(payload["extra"])
        self.step = int(payload["step"])
        # The optimizer's saved groups carry the LR of their world; recompute it here.
        self.lr.apply(self.step)

    def _maybe_checkpoint(self) -> None:
        if self.checkpointer is None:
            return
        last_step, last_time = self._last_checkpoint
        policy = CheckpointPolicy.from_settings(self.binding.world.checkpoint)
        if policy.due(step=self.step, now=self._clock(), last_step=last_step,
                      last_time=last_time):
            self.save_checkpoint()


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
