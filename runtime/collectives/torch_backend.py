"""The torch.distributed backend: gloo on CPU, NCCL on CUDA, one process group per generation.

Each generation gets a fresh default process group built on that generation's store (see
:mod:`ringwright.runtime.membership.generation_store`). Forming it is bounded by
``group_init_timeout_s``; its collectives then get the long ``collective_timeout_s``,
a last resort only: a dead peer is found by the heartbeats, which abort the group
from their thread. Gloo is aborted by shutting down the connections it opened
(:mod:`ringwright.runtime.collectives.sockets`), NCCL with ``ncclCommAbort`` through the process
group's ``abort()``; either way the blocked collective raises at once, in the
runtime's code or in the user's own ``torch.distributed`` calls. Library exceptions
are translated into :class:`CollectiveError`; nothing else in the runtime needs to
know which library raised them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, MutableMapping, Sequence
from datetime import timedelta
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import PrefixStore, Store

from ringwright.world import World

from ..kvlog import log_event, runtime_logger
from ..membership.generation_store import GenerationStores
from ..membership.liveness import LagListener, PeerFailure
from ..settings import RuntimeSettings
from .backend import CollectiveError, PeerFailureListener, as_collective_failure, collective
from .flat import by_dtype, flatten, gradients, unflatten_into
from .hierarchical import RackGroups, rack_plan
from .sockets import GroupSockets

_log = runtime_logger("torch_backend")

T = TypeVar("T")

NCCL_ERROR_ENV = {
    # Abort the communicators of a failed collective and raise in the training
    # thread, instead of the default of killing the whole process: the process has
    # to survive to roll back and join the next world.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    # Make a timed-out collective raise where it is waited on.
    "TORCH_NCCL_BLOCKING_WAIT": "1",
    # Non-blocking communicator init: an init stuck on a dead peer can be aborted
    # from the heartbeat thread and is bounded by the init timeout.
    "TORCH_NCCL_USE_COMM_NONBLOCKING": "1",
}
"""Set (overriding the image's values, which would make a failure kill the process)
before the first NCCL group of the process is created."""


def apply_nccl_env(environ: MutableMapping[str, str]) -> None:
    """Put the NCCL error handling the runtime relies on into ``environ``."""
    environ.update(NCCL_ERROR_ENV)


class TorchDistributedBackend:
    """torch.distributed with a default process group that is rebuilt for every generation."""

    def __init__(
        self,
        device: torch.device,
        settings: RuntimeSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        environ: MutableMapping[str, str] | None = None,
        on_heartbeat_lag: LagListener | None = None,
    ) -> None:
        self._device = device
        self._settings = settings
        self._clock = clock
        self._stores = GenerationStores(settings, clock, on_heartbeat_lag=on_heartbeat_lag)
        self._joined = False
        self._lock = threading.Lock()
        self._sockets: GroupSockets | None = None
        self._aborted: str | None = None
        self._racks: RackGroups | None = None
        if device.type == "cuda":
            apply_nccl_env(os.environ if environ is None else environ)

    @property
    def name(self) -> str:
        """``nccl`` for CUDA tensors, ``gloo`` otherwise."""
        return "nccl" if self._device.type == "cuda" else "gloo"

    @property
    def device(self) -> torch.device:
        """The device of the training state's tensors."""
        return self._device

    def init(self, world: World, rank: int, superseded: Callable[[], bool],
             on_peer_failure: PeerFailureListener) -> None:
        """Rendezvous on rank 0's store for ``world``, then create the process group."""
        self.shutdown()
        s = self._settings

        def peer_failed(failure: PeerFailure) -> None:
            # Reported first, so the rollback's own report already names the suspects.
            on_peer_failure(failure)
            self.abort(f"peers dead: {failure.evidence}")

        with self._lock:
            self._aborted = None
            self._sockets = GroupSockets(keep_ports={world.store.port, s.readiness_port})
        store = self._stores.meet(
            world, rank, superseded, peer_failed,
            on_abandoned=lambda why: self.abort(f"a peer moved on: {why}"))
        started = self._clock()
        with collective(f"creating the {self.name} group of generation {world.generation}"):
            if self._device.type == "cuda":
                torch.cuda.set_device(self._device)
            forming = forming_timeout(self.name, s.group_init_timeout_s)
            init_default_group(
                backend=self.name,
                store=PrefixStore("group/", store),
                rank=rank,
                world_size=world.size,
                timeout=forming,
                device_id=self._device if self._device.type == "cuda" else None,
            )
            self._joined = True
            plan = rack_plan(world, self.name)
            # The rack groups connect now, before the group counts as formed, so an
            # abort shuts their connections down with the default group's.
            # Bounded like the default group's init: a peer that left after the barrier
            # must not keep the others in the subgroups' connection mesh for the long
            # collective timeout.
            self._racks = (RackGroups(plan, rank, forming) if plan is not None else None)
            with self._lock:
                if self._sockets is not None:
                    self._sockets.formed()
                aborted = self._aborted
            if aborted is not None:
                raise CollectiveError(f"group aborted while forming: {aborted}")
            # Forming is bounded tightly; a collective may wait for a slow peer long.
            _default_group().set_timeout(timedelta(seconds=s.collective_timeout_s))
            if self._racks is not None:
                self._racks.set_timeout(timedelta(seconds=s.collective_timeout_s))
        log_event(_log, logging.INFO, "group_formed", backend=self.name,
                  generation=world.generation, rank=rank, size=world.size,
                  racks=len(plan.racks) if plan else 1, hierarchical=plan is not None,
                  seconds=self._clock() - started)

    def abort(self, reason: str) -> None:
        """Fail the group's blocked and later collectives now (from any thread)."""
        with self._lock:
            if self._aborted is not None or self._sockets is None:
                return
            self._aborted = reason
            if self.name == "nccl":
                aborted = self._abort_nccl()
            else:
                aborted = f"{self._sockets.abort()} connections shut down"
        log_event(_log, logging.WARNING, "group_aborted", backend=self.name, reason=reason,
                  done=aborted)

    def failure_of(self, err: BaseException) -> CollectiveError | None:
        """Library errors, and any runtime error once the group was aborted."""
        with self._lock:
            aborted = self._aborted
        return as_collective_failure(err, aborted, _library_failure)

    def shutdown(self, *, left_cleanly: bool = False) -> None:
        """Destroy the current process group and drop this generation's store connections."""
        with self._lock:
            self._sockets = None
        self._racks = None
        if self._joined:
            self._joined = False
            try:
                dist.destroy_process_group()
            except RuntimeError as err:
                # A group broken by a dead peer may refuse a clean teardown; it is
                # abandoned either way and the next generation builds a new one.
                log_event(_log, logging.WARNING, "group_teardown_failed", error=err)
        self._stores.release(left_cleanly=left_cleanly)

    def _abort_nccl(self) -> str:
        # Still forming: the non-blocking init is bounded by the init timeout.
        return abort_group(dist.group.WORLD if dist.is_initialized() else None)

    def close(self) -> None:
        """Leave the group and stop hosting a store."""
        self.shutdown(left_cleanly=True)
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
        world's racks call for it (see :mod:`ringwright.runtime.collectives.hierarchical`)."""
        racks = self._racks
        with collective(f"{name} allreduce"):
            if racks is not None and racks.plan.takes(flat.numel() * flat.element_size()):
                racks.allreduce_(flat)
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



class Abortable(Protocol):
    """A process group whose communicators can be aborted (NCCL's ``ncclCommAbort``)."""

    def abort(self) -> None:
        """Abort every communicator: blocked and later operations fail at once."""
        ...


def abort_group(group: Abortable | None) -> str:
    """Abort ``group`` (None: not formed yet); what happened, for the log."""
    if group is None:
        return "no group formed yet"
    try:
        group.abort()
    except RuntimeError as err:
        return f"abort failed: {err}"
    return "communicators aborted"


# Gloo waits for a peer's first connection five times the group's timeout (its
# passive side of a pair has no other deadline, and no socket an abort could shut),
# so a peer that died between the join barrier and the connection would hold the
# others for five times group_init_timeout_s: five minutes at the default.
GLOO_CONNECT_WAIT_FACTOR = 5


def forming_timeout(backend: str, group_init_timeout_s: float) -> timedelta:
    """The timeout to create a ``backend`` process group with, so that forming it ends
    within ``group_init_timeout_s`` however a peer fails."""
    if backend == "gloo":
        return timedelta(seconds=group_init_timeout_s / GLOO_CONNECT_WAIT_FACTOR)
    return timedelta(seconds=group_init_timeout_s)


def init_default_group(backend: str, store: Store, rank: int, world_size: int,
                       timeout: timedelta, device_id: torch.device | None) -> None:
    """``dist.init_process_group`` with these arguments, leaving torch's count of groups
    where it found it (0) when it fails.

    torch names each group by that process-wide count, and the name prefixes the group's
    keys in the store. A failed init (a peer that never came, a timeout) has counted its
    group already and leaves no default group that ``destroy_process_group`` could undo:
    the next generation's group would then be "1" here and "0" on every peer, whose
    keys never meet, and every later generation would time out the same way.
    """
    try:
        dist.init_process_group(backend=backend, store=store, rank=rank,
                                world_size=world_size, timeout=timeout, device_id=device_id)
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()  # which resets the count too
        else:
            c10d._world.group_count = 0
        raise


def _default_group() -> dist.ProcessGroup:
    group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise CollectiveError("no process group is formed")
    return group


_LIBRARY_MARKERS = ("gloo", "nccl", "connection closed by peer", "connection reset")


def _library_failure(err: RuntimeError, text: str) -> str | None:
    # Gloo reports a lost peer as a plain RuntimeError naming its own source files.
    lowered = text.lower()
    if isinstance(err, dist.DistError) or any(m in lowered for m in _LIBRARY_MARKERS):
        return "collective failed"
    return None
