"""The rendezvous store of one world epoch, hosted by that epoch's rank 0.

Rank 0 serves a TCPStore on the world's store address. The listening socket is
bound by us to that address only (not to every interface), so several pods that
share a machine, as local stand-ins on loopback addresses do, can each host a store
on the same port. A pod that stays rank 0 at the same address keeps its server
across epochs; every key lives under an epoch prefix, so members of an old epoch can
never read or write the keys of a new one.

Before the process group is created every member passes :func:`join_barrier`,
which is abortable: while waiting it keeps asking whether a newer world has replaced
this one, so a member that died before arriving costs one epoch bump rather than a
full timeout. From the barrier on, every member heartbeats on the epoch's store
(:mod:`ringwright.runtime.liveness`) until it leaves the epoch.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

# torch.distributed re-exports these without declaring them, so type checkers only
# see them in the extension module that defines them.
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from ringwright.world import World

from .backend import CollectiveError, RankTaken, Superseded
from .liveness import Heartbeat, LagListener, PeerFailure, heartbeat_key
from .settings import RuntimeSettings

WAIT_SLICE_S = 0.2
"""Longest single store wait; bounds how late a newer world is noticed while joining."""


def epoch_prefix(world: World) -> str:
    """Key prefix of ``world``'s epoch (job-qualified, in case stores are ever shared)."""
    return f"ringwright/{world.job.namespace}/{world.job.name}/epoch-{world.epoch}/"


class StoreHost:
    """This pod's store server, kept while the pod stays rank 0 at the same address."""

    def __init__(self) -> None:
        self._address: tuple[str, int] | None = None
        self._store: TCPStore | None = None

    def serve(self, address: str, port: int, timeout_s: float) -> TCPStore:
        """The server store at ``address:port``, started if not already running there."""
        if self._store is not None and self._address == (address, port):
            return self._store
        self.close()
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            # A store of a previous epoch at this address may leave TIME_WAIT sockets.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address, port))
            sock.listen(1024)
        except OSError as err:
            sock.close()
            raise CollectiveError(f"cannot host the store on {address}:{port}: {err}") from err
        # The store owns the descriptor from here on and closes it when destroyed.
        fd = sock.detach()
        self._store = TCPStore(
            address, port, None, True, timedelta(seconds=timeout_s),
            wait_for_workers=False, master_listen_fd=fd,
        )
        self._address = (address, port)
        return self._store

    def close(self) -> None:
        """Stop serving (members still connected see their next request fail)."""
        self._store = None
        self._address = None


def connect_client(
    address: str,
    port: int,
    *,
    timeout_s: float,
    attempt_s: float,
    deadline: float,
    superseded: Callable[[], bool],
    clock: Callable[[], float] = time.monotonic,
) -> TCPStore:
    """Connect to rank 0's store, retrying in short attempts until ``deadline``."""
    while True:
        try:
            store = TCPStore(address, port, None, False, timedelta(seconds=attempt_s),
                                  wait_for_workers=False)
        except dist.DistError as err:
            if superseded():
                raise Superseded from err
            if clock() >= deadline:
                raise CollectiveError(
                    f"store {address}:{port} of rank 0 unreachable until the deadline: {err}"
                ) from err
            continue
        store.set_timeout(timedelta(seconds=timeout_s))
        return store


def join_barrier(
    store: Store,
    rank: int,
    size: int,
    *,
    deadline: float,
    superseded: Callable[[], bool],
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Claim ``rank`` in this epoch and wait until all ``size`` ranks have claimed theirs.

    Raises :class:`RankTaken` when another process claimed the rank first (a restarted
    container whose previous incarnation already joined this epoch).
    """
    try:
        if store.add(f"claim/{rank}", 1) != 1:
            raise RankTaken(f"rank {rank} was already claimed in this epoch by another process")
        # Every counter exists once the barrier completes: peers read them all at once.
        store.set(heartbeat_key(rank), "0")
        if store.add("arrived", 1) == size:
            store.set("complete", "1")
    except dist.DistError as err:
        raise CollectiveError(f"store failed while joining: {err}") from err
    while True:
        try:
            store.wait(["complete"], timedelta(seconds=WAIT_SLICE_S))
            return
        except dist.DistNetworkError as err:
            raise CollectiveError(f"lost the store while joining: {err}") from err
        except dist.DistStoreError:
            # Not everyone has arrived yet; keep waiting unless the world moved on.
            if superseded():
                raise Superseded from None
            if clock() >= deadline:
                arrived = store.add("arrived", 0)
                raise CollectiveError(
                    f"only {arrived} of {size} members arrived before the rendezvous deadline"
                ) from None


class EpochStores:
    """A member's side of the epoch stores: the server it hosts while rank 0, and the
    connections of the current epoch. Every backend forms its group only after
    :meth:`meet`, so a member that never arrives costs an epoch bump, not a library
    timeout."""

    def __init__(self, settings: RuntimeSettings,
                 clock: Callable[[], float] = time.monotonic, *,
                 on_heartbeat_lag: LagListener | None = None) -> None:
        self._settings = settings
        self._clock = clock
        self._on_lag = on_heartbeat_lag
        self._host = StoreHost()
        self._stores: list[Store] = []
        self._heartbeat: Heartbeat | None = None

    def meet(self, world: World, rank: int, superseded: Callable[[], bool],
             on_failure: Callable[[PeerFailure], None] | None = None) -> Store:
        """Reach ``world``'s store (hosting it as rank 0) and pass the join barrier;
        then heartbeat, calling ``on_failure`` (from the heartbeat thread) when peers
        are found dead.

        Returns the store under the epoch's prefix, kept open until :meth:`release`.
        """
        self.release()
        s, clock = self._settings, self._clock
        deadline = clock() + s.rendezvous_timeout_s
        at = world.store
        if rank == 0:
            raw: Store = self._host.serve(at.address, at.port, s.collective_timeout_s)
        else:
            # This pod no longer hosts the store: release its port and stale keys.
            self._host.close()
            raw = connect_client(at.address, at.port, timeout_s=s.collective_timeout_s,
                                 attempt_s=s.connect_retry_s, deadline=deadline,
                                 superseded=superseded, clock=clock)
        store = PrefixStore(epoch_prefix(world), raw)
        self._stores = [raw, store]
        join_barrier(store, rank, world.size, deadline=deadline, superseded=superseded,
                     clock=clock)
        if on_failure is not None:
            self._heartbeat = Heartbeat(
                lambda timeout_s: self._connect(world, timeout_s), world, rank,
                interval_s=s.heartbeat_interval_s, detect_s=s.failure_detect_s,
                on_failure=on_failure, on_lag=self._on_lag, clock=clock)
            self._heartbeat.start()
        return store

    def release(self, *, left_cleanly: bool = False) -> None:
        """Stop heartbeating and drop this epoch's connections (the server, if hosted,
        stays for the next). ``left_cleanly`` tells the peers not to wait for this
        member: it finished, or every member agreed to move on."""
        if self._heartbeat is not None:
            self._heartbeat.stop(left_cleanly=left_cleanly)
            self._heartbeat = None
        self._stores = []

    def close(self) -> None:
        """Drop the connections and stop hosting a store."""
        self.release(left_cleanly=True)
        self._host.close()

    @staticmethod
    def _connect(world: World, timeout_s: float) -> Store:
        at = world.store
        raw = TCPStore(at.address, at.port, None, False, timedelta(seconds=timeout_s),
                       wait_for_workers=False)
        return PrefixStore(epoch_prefix(world), raw)
