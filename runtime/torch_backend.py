"""The torch.distributed backend: gloo on CPU, NCCL on CUDA, one process group per epoch.

Each epoch gets a fresh default process group built on that epoch's store (see
:mod:`ringwright.runtime.epoch_store`) with a short timeout, so a dead or hung peer
fails the next collective within seconds. Library exceptions from collectives are
translated into :class:`CollectiveError`; nothing else in the runtime needs to know
which library raised them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store

from ringwright.world import World

from .backend import CollectiveError
from .epoch_store import StoreHost, connect_client, epoch_prefix, join_barrier
from .kvlog import log_event, runtime_logger
from .settings import RuntimeSettings

_log = runtime_logger("torch_backend")

T = TypeVar("T")

NCCL_ERROR_ENV = {
    # Abort the communicators of a failed collective and raise in the training
    # thread, instead of the default of killing the whole process: the process has
    # to survive to roll back and join the next world.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    # Make a timed-out collective raise where it is waited on.
    "TORCH_NCCL_BLOCKING_WAIT": "1",
}


@contextlib.contextmanager
def _collective(what: str) -> Iterator[None]:
    """Translate a library failure inside a collective into :class:`CollectiveError`."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as err:
        # Gloo reports a dead peer as a plain RuntimeError, NCCL and the store as
        # DistError subclasses; both mean the group is unusable.
        raise CollectiveError(f"{what} failed: {err}") from err


class TorchDistributedBackend:
    """torch.distributed with a default process group that is rebuilt for every epoch."""

    def __init__(
        self,
        device: torch.device,
        settings: RuntimeSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._device = device
        self._settings = settings
        self._clock = clock
        self._host = StoreHost()
        self._stores: list[Store] = []
        self._joined = False
        if device.type == "cuda":
            for key, value in NCCL_ERROR_ENV.items():
                os.environ.setdefault(key, value)

    @property
    def name(self) -> str:
        """``nccl`` for CUDA tensors, ``gloo`` otherwise."""
        return "nccl" if self._device.type == "cuda" else "gloo"

    @property
    def device(self) -> torch.device:
        """The device of the training state's tensors."""
        return self._device

    def init(self, world: World, rank: int, superseded: Callable[[], bool]) -> None:
        """Rendezvous on rank 0's store for ``world``, then create the process group."""
        self.shutdown()
        s = self._settings
        deadline = self._clock() + s.rendezvous_timeout_s
        store_at = world.store
        if rank == 0:
            raw: Store = self._host.serve(store_at.address, store_at.port,
                                               s.collective_timeout_s)
        else:
            # This pod no longer hosts the store: release its port and stale keys.
            self._host.close()
            raw = connect_client(store_at.address, store_at.port,
                                 timeout_s=s.collective_timeout_s, attempt_s=s.connect_retry_s,
                                 deadline=deadline, superseded=superseded, clock=self._clock)
        store = PrefixStore(epoch_prefix(world), raw)
        self._stores = [raw, store]
        join_barrier(store, rank, world.size, deadline=deadline, superseded=superseded,
                     clock=self._clock)
        started = self._clock()
        with _collective(f"creating the {self.name} group of epoch {world.epoch}"):
            if self._device.type == "cuda":
                torch.cuda.set_device(self._device)
            dist.init_process_group(
                backend=self.name,
                store=PrefixStore("group/", store),
                rank=rank,
                world_size=world.size,
                timeout=timedelta(seconds=s.collective_timeout_s),
                device_id=self._device if self._device.type == "cuda" else None,
            )
            self._joined = True
        log_event(_log, logging.INFO, "group_formed", backend=self.name, epoch=world.epoch,
                  rank=rank, size=world.size, seconds=self._clock() - started)

    def shutdown(self) -> None:
        """Destroy the current process group and drop this epoch's store connections."""
        if self._joined:
            self._joined = False
            try:
                dist.destroy_process_group()
            except RuntimeError as err:
                # A group broken by a dead peer may refuse a clean teardown; it is
                # abandoned either way and the next epoch builds a new one.
                log_event(_log, logging.WARNING, "group_teardown_failed", error=err)
        self._stores = []

    def close(self) -> None:
        """Leave the group and stop hosting a store."""
        self.shutdown()
        self._host.close()

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], src: int) -> None:
        """Broadcast in one flat buffer per dtype, then copy back into ``tensors``."""
        with _collective("broadcast"):
            for group in _by_dtype(tensors):
                flat = torch.cat([t.detach().reshape(-1) for t in group]).to(self._device)
                dist.broadcast(flat, src)
                _unflatten_into(flat, group)

    def broadcast_object(self, obj: T, src: int) -> T:
        """Pickle ``src``'s object to every rank."""
        box: list[object] = [obj]
        with _collective("object broadcast"):
            dist.broadcast_object_list(box, src, device=self._device)
        result: T = box[0]  # type: ignore[assignment]
        return result

    def allgather_object(self, obj: T) -> list[T]:
        """Every rank's pickled object."""
        out: list[object] = [None] * dist.get_world_size()
        with _collective("object allgather"):
            dist.all_gather_object(out, obj)
        return out  # type: ignore[return-value]

    def allreduce_gradients(self, params: Iterable[torch.Tensor], *, average: bool) -> None:
        """One allreduce per dtype over all gradients; missing gradients count as zero."""
        grads: list[torch.Tensor] = []
        for p in params:
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        with _collective("gradient allreduce"):
            for group in _by_dtype(grads):
                flat = torch.cat([g.reshape(-1) for g in group])
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
                if average:
                    flat /= dist.get_world_size()
                _unflatten_into(flat, group)

    def allreduce_max(self, value: int) -> int:
        """Largest ``value`` over the group."""
        t = torch.tensor([value], dtype=torch.int64, device=self._device)
        with _collective("max allreduce"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def barrier(self) -> None:
        """Wait for every rank."""
        with _collective("barrier"):
            dist.barrier()


def _by_dtype(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


def _unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n
