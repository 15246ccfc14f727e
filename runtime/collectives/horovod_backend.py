"""The Horovod backend: ``horovod.torch`` over gloo, re-initialized for every world generation.

Horovod is driven from our world, not by ``horovodrun``: for each generation every member
first passes our own join barrier on the generation's store (abortable, so a member that
never arrives costs a generation bump); rank 0 then starts a fresh Horovod rendezvous
store and publishes its port on the generation's store; every member sets the variables
Horovod's gloo controller reads and calls ``hvd.init()``. The next generation calls
``hvd.shutdown()`` and does it all again in the same process.

Horovod cannot report a failure *during* ``hvd.init()`` to Python: its background
thread aborts the process, and a peer lost inside its rendezvous leaves the others
polling for that peer's address until Horovod's (long) timeout. The barrier before it
keeps that window to the rendezvous itself. A peer found dead inside it makes every
survivor call :attr:`HorovodBackend.on_stuck_init`: the runtime saves the last commit
and exits, to be restarted like any crashed container and rejoin a later generation.
Failures in collectives surface as ``HorovodInternalError`` and take the usual
rollback path (see docs/horovod-gloo-notes.md for what was verified about Horovod
0.28.1).

Horovod's one gloo timeout covers both forming the group and every operation, so it
is set long (``collective_timeout_s``: a slow peer is not fatal). A dead peer is
found by the heartbeats instead, which abort Horovod by shutting down the gloo
connections that ``hvd.init()`` opened (:mod:`ringwright.runtime.collectives.sockets`): every
pending and later operation then fails at once with ``HorovodInternalError``
(docs/failure-detection.md).

Every collective is named: Horovod matches tensors across ranks by name, and its
automatic names count calls per process, which differ between a survivor and a
newcomer.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, MutableMapping, Sequence
from typing import Any, TypeVar, cast

import torch

from ringwright.world import World

from ..kvlog import log_event, runtime_logger
from ..membership.generation_store import GenerationStores, await_published
from ..membership.liveness import LagListener, PeerFailure
from ..settings import RuntimeSettings
from .backend import CollectiveError, PeerFailureListener, as_collective_failure, collective
from .flat import by_dtype, flatten, gradients, unflatten_into
from .horovod_store import RendezvousStore
from .sockets import GroupSockets

_log = runtime_logger("horovod_backend")

T = TypeVar("T")

RENDEZVOUS_KEY = "horovod/rendezvous"
"""Key on the generation's store under which rank 0 publishes ``<address>:<port>``."""


def import_horovod() -> Any:
    """``horovod.torch``, or an error that says how to get it."""
    try:
        import horovod.torch as hvd  # type: ignore[import-untyped]
    except ImportError as err:
        raise RuntimeError(
            "backend 'horovod' needs Horovod built against this torch: install "
            "ringwright[horovod] in the training image, or run scripts/build_horovod.sh "
            f"<venv> ({err})"
        ) from err
    return hvd


def horovod_env(world: World, rank: int, store_address: str, store_port: int,
                timeout_s: float) -> dict[str, str]:
    """What Horovod's gloo controller reads at ``hvd.init()`` for ``rank`` of ``world``.

    Each pod is one host to Horovod: its local ranks are Horovod's local ranks, and
    the cross rank is the pod's place among the world's pods.
    """
    member = world.members[rank]
    pods = world.local_ranks()
    env = {
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": store_address,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(store_port),
        "HOROVOD_GLOO_TIMEOUT_SECONDS": str(max(1, round(timeout_s))),
        "HOROVOD_RANK": str(rank),
        "HOROVOD_SIZE": str(world.size),
        "HOROVOD_LOCAL_RANK": str(member.local_rank),
        "HOROVOD_LOCAL_SIZE": str(len(pods[member.pod])),
        "HOROVOD_CROSS_RANK": str(list(pods).index(member.pod)),
        "HOROVOD_CROSS_SIZE": str(len(pods)),
        # Names the local scope on the store; pod names are unique and URL-safe.
        "HOROVOD_HOSTNAME": member.pod,
    }
    if ipaddress.ip_address(member.ip).is_loopback:
        # Pods standing in as loopback addresses: gloo must listen on lo, not on
        # whatever the machine's hostname resolves to.
        env["HOROVOD_GLOO_IFACE"] = "lo"
    return env


class HorovodBackend:
    """``horovod.torch`` with gloo, one ``hvd.init()`` per world generation."""

    def __init__(
        self,
        device: torch.device,
        settings: RuntimeSettings,
        *,
        hvd: Any = None,
        environ: MutableMapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_heartbeat_lag: LagListener | None = None,
    ) -> None:
        self._hvd = hvd if hvd is not None else import_horovod()
        self._device = device
        # Horovod built without NCCL reduces CUDA tensors through host memory.
        self._comm_device = (device if device.type == "cpu" or self._hvd.nccl_built()
                             else torch.device("cpu"))
        self._settings = settings
        self._environ = os.environ if environ is None else environ
        self._clock = clock
        self._stores = GenerationStores(settings, clock, on_heartbeat_lag=on_heartbeat_lag)
        self._rendezvous: RendezvousStore | None = None
        self._joined = False
        self._lock = threading.Lock()
        self._sockets: GroupSockets | None = None
        self._aborted: str | None = None
        self._in_init = False
        self.on_stuck_init: Callable[[PeerFailure], None] | None = None
        """Called (from the heartbeat thread) when a peer is found dead while this
        process is inside ``hvd.init()``, which nothing can interrupt; it should not
        return (save what is needed and exit). Unset: wait for Horovod's timeout."""

    @property
    def name(self) -> str:
        """Always ``horovod``."""
        return "horovod"

    @property
    def device(self) -> torch.device:
        """The device of the training state's tensors."""
        return self._device

    def init(self, world: World, rank: int, superseded: Callable[[], bool],
             on_peer_failure: PeerFailureListener) -> None:
        """Meet on the generation's store, then ``hvd.init()`` on a fresh rendezvous store."""
        self.shutdown()
        s = self._settings

        dead: list[str] = []

        def peer_failed(failure: PeerFailure) -> None:
            dead.append(failure.evidence)
            # Reported first, so the rollback's own report already names the suspects.
            on_peer_failure(failure)
            if self._in_init and self.on_stuck_init is not None:
                self.on_stuck_init(failure)
            self.abort(f"peers dead: {failure.evidence}")

        store = self._stores.meet(
            world, rank, superseded, peer_failed,
            on_abandoned=lambda why: self.abort(f"a peer moved on: {why}"))
        started = self._clock()
        if rank == 0:
            self._rendezvous = RendezvousStore(world.store.address)
            at = f"{self._rendezvous.address}:{self._rendezvous.port}"
            with collective("publishing the Horovod rendezvous store"):
                store.set(RENDEZVOUS_KEY, at)
        else:
            with collective("reading the Horovod rendezvous store's address"):
                at = await_published(store, RENDEZVOUS_KEY, superseded=superseded,
                                     peers_dead=lambda: f"peers dead: {dead[0]}" if dead
                                     else None).decode()
        address, _, port = at.rpartition(":")
        self._environ.update(horovod_env(world, rank, address, int(port),
                                         s.collective_timeout_s))
        with self._lock:
            self._aborted = None
            self._sockets = GroupSockets(
                keep_ports={world.store.port, int(port), s.readiness_port})
        self._in_init = True
        try:
            with collective(f"hvd.init() for generation {world.generation}"):
                self._hvd.init()
        finally:
            self._in_init = False
        self._joined = True
        with self._lock:
            if self._sockets is not None:
                self._sockets.formed()
        if (self._hvd.rank(), self._hvd.size()) != (rank, world.size):
            raise CollectiveError(
                f"Horovod joined as rank {self._hvd.rank()} of {self._hvd.size()}, "
                f"expected {rank} of {world.size} in generation {world.generation}")
        log_event(_log, logging.INFO, "group_formed", backend=self.name,
                  generation=world.generation, rank=rank, size=world.size,
                  seconds=self._clock() - started)

    def abort(self, reason: str) -> None:
        """Fail Horovod's pending and later operations now (from any thread)."""
        with self._lock:
            if self._aborted is not None or self._sockets is None:
                return
            self._aborted = reason
            closed = self._sockets.abort()
        log_event(_log, logging.WARNING, "group_aborted", backend=self.name, reason=reason,
                  done=f"{closed} connections shut down")

    def failure_of(self, err: BaseException) -> CollectiveError | None:
        """``HorovodInternalError`` (and its kin), and any runtime error after an abort."""
        with self._lock:
            aborted = self._aborted
        return as_collective_failure(err, aborted, _horovod_failure)

    def shutdown(self, *, left_cleanly: bool = False) -> None:
        """``hvd.shutdown()`` and drop this generation's stores."""
        with self._lock:
            self._sockets = None
        if self._joined:
            self._joined = False
            try:
                self._hvd.shutdown()
            except RuntimeError as err:
                log_event(_log, logging.WARNING, "group_teardown_failed", error=err)
        if self._rendezvous is not None:
            self._rendezvous.close()
            self._rendezvous = None
        self._stores.release(left_cleanly=left_cleanly)

    def close(self) -> None:
        """Leave the group and stop hosting the generation store."""
        self.shutdown(left_cleanly=True)
        self._stores.close()

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], src: int) -> None:
        """Broadcast one flat buffer per dtype from ``src``, then copy back."""
        with collective("broadcast"):
            for i, group in enumerate(by_dtype(tensors)):
                flat = flatten(group, self._comm_device)
                self._hvd.broadcast_(flat, root_rank=src, name=f"ringwright.broadcast.{i}")
                unflatten_into(flat, group)

    def broadcast_object(self, obj: T, src: int) -> T:
        """``src``'s pickled object on every rank."""
        with collective("object broadcast"):
            return cast(T, self._hvd.broadcast_object(obj, root_rank=src,
                                                      name="ringwright.broadcast_object"))

    def allgather_object(self, obj: T) -> list[T]:
        """Every rank's pickled object, indexed by rank."""
        with collective("object allgather"):
            return cast(list[T], self._hvd.allgather_object(obj,
                                                            name="ringwright.allgather_object"))

    def allreduce_gradients(self, params: Iterable[torch.Tensor], *, average: bool) -> None:
        """One allreduce per dtype over all gradients; missing gradients count as zero."""
        op = self._hvd.Average if average else self._hvd.Sum
        with collective("gradient allreduce"):
            for i, group in enumerate(by_dtype(gradients(params))):
                flat = flatten(group, self._comm_device)
                self._hvd.allreduce_(flat, op=op, name=f"ringwright.gradients.{i}")
                unflatten_into(flat, group)

    def allreduce_(self, flat: torch.Tensor, name: str) -> None:
        """Sum one contiguous tensor over the world in place (Horovod's own ring)."""
        with collective(f"{name} allreduce"):
            on_comm = flat.to(self._comm_device)
            self._hvd.allreduce_(on_comm, op=self._hvd.Sum, name=f"ringwright.{name}")
            if on_comm is not flat:
                flat.copy_(on_comm)

    def allreduce_max(self, value: int) -> int:
        """Largest ``value`` over the group."""
        t = torch.tensor([value], dtype=torch.int64, device=self._comm_device)
        with collective("max allreduce"):
            out = self._hvd.allreduce(t, op=self._hvd.Max, name="ringwright.max")
        return int(out.item())

    def barrier(self) -> None:
        """Wait for every rank."""
        with collective("barrier"):
            self._hvd.barrier()


def _horovod_failure(err: RuntimeError, text: str) -> str | None:
    return "Horovod operation failed" if type(err).__module__.startswith("horovod") else None
