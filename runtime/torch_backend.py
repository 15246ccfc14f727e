"""The torch.distributed backend: gloo on CPU, NCCL on CUDA, one process group per epoch.

Each epoch gets a fresh default process group built on that epoch's store (see
:mod:`ringwright.runtime.epoch_store`) with a short timeout, so a dead or hung peer
fails the next collective within seconds. Library exceptions from collectives are
translated into :class:`CollectiveError`; nothing else in the runtime needs to know
which library raised them.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore

from ringwright.world import World

from .backend import collective
from .epoch_store import EpochStores
from .flat import by_dtype, flatten, gradients, unflatten_into
from .hierarchical import RackGroups, rack_plan
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
        self._stores = EpochStores(settings, clock)
        self._joined = False
        self._racks: RackGroups | None = None
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
        store = self._stores.meet(world, rank, superseded)
        started = self._clock()
        with collective(f"creating the {self.name} group of epoch {world.epoch}"):
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
            plan = rack_plan(world)
            self._racks = (RackGroups(plan, rank, timedelta(seconds=s.collective_timeout_s))
                           if plan is not None else None)
        log_event(_log, logging.INFO, "group_formed", backend=self.name, epoch=world.epoch,
                  rank=rank, size=world.size, racks=len(plan.racks) if plan else 1,
                  hierarchical=plan is not None, seconds=self._clock() - started)

    def shutdown(self) -> None:
        """Destroy the current process group and drop this epoch's store connections."""
        self._racks = None
        if self._joined:
            self._joined = False
            try:
                dist.destroy_process_group()
            except RuntimeError as err:
                # A group broken by a dead peer may refuse a clean teardown; it is
                # abandoned either way and the next epoch builds a new one.
                log_event(_log, logging.WARNING, "group_teardown_failed", error=err)
        self._stores.release()

    def close(self) -> None:
        """Leave the group and stop hosting a store."""
        self.shutdown()
        self._stores.close()

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], src: int) -> None:
        """Broadcast in one flat buffer per dtype, then copy back into ``tensors``."""
        with collective("broadcast"):
            for group in by_dtype(tensors):
                flat = flatten(group, self._device)
                dist.broadcast(flat, src)
                unflatten_into(flat, group)

    def broadcast_object(self, obj: T, src: int) -> T:
        """Pickle ``src``'s object to every rank."""
        box: list[object] = [obj]
        with collective("object broadcast"):
            dist.broadcast_object_list(box, src, device=self._device)
        result: T = box[0]  # type: ignore[assignment]
        return result

    def allgather_object(self, obj: T) -> list[T]:
        """Every rank's pickled object."""
        out: list[object] = [None] * dist.get_world_size()
        with collective("object allgather"):
            dist.all_gather_object(out, obj)
        return out  # type: ignore[return-value]

    def allreduce_gradients(self, params: Iterable[torch.Tensor], *, average: bool) -> None:
        """One allreduce per dtype over all gradients; missing gradients count as zero."""
        for group in by_dtype(gradients(params)):
            flat = flatten(group, group[0].device)
            self.allreduce_(flat, "gradients")
            if average:
                flat /= dist.get_world_size()
            unflatten_into(flat, group)

    def allreduce_(self, flat: torch.Tensor, name: str) -> None:
        """Sum one contiguous tensor over the world in place: in two levels when the
        world's racks call for it (see :mod:`ringwright.runtime.hierarchical`)."""
        with collective(f"{name} allreduce"):
            if self._racks is not None:
                self._racks.allreduce_(flat)
            else:
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)

    def allreduce_max(self, value: int) -> int:
        """Largest ``value`` over the group."""
        t = torch.tensor([value], dtype=torch.int64, device=self._device)
        with collective("max allreduce"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def barrier(self) -> None:
        """Wait for every rank."""
        with collective("barrier"):
            dist.barrier()

