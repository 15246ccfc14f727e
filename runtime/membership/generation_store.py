"""The rendezvous store of one world generation, hosted by that generation's rank 0.

Rank 0 serves a TCPStore on the world's store address. The listening socket is
bound by us to that address only (not to every interface), so several pods that
share a machine, as local stand-ins on loopback addresses do, can each host a store
on the same port. A pod that stays rank 0 at the same address keeps its server
across generations; every key lives under a generation prefix, so members of an old generation can
never read or write the keys of a new one.

Before the process group is created every member passes :func:`join_barrier`,
which is abortable: while waiting it keeps asking whether a newer world has replaced
this one, so a member that died before arriving costs one generation bump rather than a
full timeout. Every value of a generation is tagged with the job's join token
(:mod:`ringwright.runtime.membership.signed_store`): a process without the token cannot claim a
rank, nor pass for a member in the library's own rendezvous. From the barrier on,
every member heartbeats on the generation's store (:mod:`ringwright.runtime.membership.liveness`)
until it leaves the generation.
"""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

# torch.distributed re-exports these without declaring them, so type checkers only
# see them in the extension module that defines them.
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from ringwright.world import World

from ..collectives.backend import CollectiveError, RanksAbsent, RankTaken, Superseded
from ..settings import RuntimeSettings
from .liveness import (
    Heartbeat,
    LagListener,
    PeerFailure,
    heartbeat_key,
    request_timeout_s,
)
from .signed_store import ForgedValue, SignedStore, generation_key

WAIT_SLICE_S = 0.2
"""Longest single store wait; bounds how late a newer world is noticed while joining."""


def generation_prefix(world: World) -> str:
    """Key prefix of ``world``'s generation (job-qualified, in case stores are ever shared)."""
    return f"ringwright/{world.job.namespace}/{world.job.name}/generation-{world.generation}/"


def generation_store(raw: Store, world: World, token: bytes) -> SignedStore:
    """``raw`` seen through ``world``'s generation prefix, its values tagged with ``token``."""
    prefix = generation_prefix(world)
    return SignedStore(PrefixStore(prefix, raw), generation_key(token, prefix))


def claim_key(store: SignedStore, rank: int) -> str:
    """Key holding the claim of ``rank`` in a generation (private to the job's token)."""
    return store.private_key(f"claim/{rank}")


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
            # A store of a previous generation at this address may leave TIME_WAIT sockets.
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
                raise RanksAbsent(
                    f"store {address}:{port} of rank 0 unreachable until the deadline: {err}",
                    (0,)) from err
            continue
        store.set_timeout(timedelta(seconds=timeout_s))
        return store


def join_barrier(
    store: SignedStore,
    rank: int,
    size: int,
    *,
    deadline: float,
    superseded: Callable[[], bool],
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Claim ``rank`` in this generation and wait until all ``size`` ranks hold a valid claim.

    A claim is a tagged value: one without the job's token is overwritten, never
    counted. Raises :class:`RankTaken` when another process with the token claimed
    the rank first (a restarted container whose previous incarnation already joined
    this generation).
    """
    mine = secrets.token_hex(8)
    try:
        try:
            held = store.compare_set(claim_key(store, rank), "", mine).decode()
        except ForgedValue:
            store.set(claim_key(store, rank), mine)
            held = mine
        if held != mine:
            raise RankTaken(
                f"rank {rank} was already claimed in this generation by another process")
        # Every heartbeat exists once the barrier completes: peers read them all at once.
        store.set(heartbeat_key(rank), "0")
    except dist.DistNetworkError as err:
        raise CollectiveError(f"store failed while joining: {err}") from err
    claims = [claim_key(store, r) for r in range(size)]
    while True:
        try:
            store.wait(claims, timedelta(seconds=WAIT_SLICE_S))
            if _valid_claims(store, claims) == size:
                return
        except dist.DistNetworkError as err:
            raise CollectiveError(f"lost the store while joining: {err}") from err
        except dist.DistStoreError:
            pass  # not every rank has a claim yet
        # Not everyone has arrived yet; keep waiting unless the world moved on.
        if superseded():
            raise Superseded from None
        if clock() >= deadline:
            absent = _absent(store, claims)
            raise RanksAbsent(
                f"only {size - len(absent)} of {size} members arrived before the rendezvous "
                f"deadline; absent: ranks {', '.join(map(str, absent))}", absent)


def await_published(
    store: Store,
    key: str,
    *,
    superseded: Callable[[], bool],
    peers_dead: Callable[[], str | None],
) -> bytes:
    """The value a peer (rank 0) publishes at ``key`` after the join barrier, waited for
    in slices.

    A member can pass the barrier while the one that publishes leaves it for a newer
    world (it saw that world first); a plain ``get`` would then wait for the store's
    whole timeout. Raises :class:`Superseded` when the world moved on, and
    :class:`CollectiveError` when ``peers_dead`` names a reason (the heartbeats found a
    peer dead) or the store is lost.
    """
    while True:
        try:
            store.wait([key], timedelta(seconds=WAIT_SLICE_S))
            return store.get(key)
        except dist.DistNetworkError as err:
            raise CollectiveError(f"lost the store while waiting for {key!r}: {err}") from err
        except dist.DistStoreError:
            pass  # not published yet
        if superseded():
            raise Superseded
        why = peers_dead()
        if why is not None:
            raise CollectiveError(f"gave up waiting for {key!r}: {why}")


def _valid_claims(store: SignedStore, claims: list[str]) -> int:
    """How many of ``claims`` exist with this job's tag."""
    return len(claims) - len(_absent(store, claims))


def _absent(store: SignedStore, claims: list[str]) -> tuple[int, ...]:
    """The ranks (indexes into ``claims``) without a claim bearing this job's tag."""
    absent = []
    for rank, key in enumerate(claims):
        if store.check([key]):
            try:
                store.get(key)
                continue
            except ForgedValue:
                pass
        absent.append(rank)
    return tuple(absent)


class GenerationStores:
    """A member's side of the generation stores: the server it hosts while rank 0, and the
    connections of the current generation. Every backend forms its group only after
    :meth:`meet`, so a member that never arrives costs a generation bump, not a library
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
             on_failure: Callable[[PeerFailure], None] | None = None,
             on_abandoned: Callable[[str], None] | None = None) -> Store:
        """Reach ``world``'s store (hosting it as rank 0) and pass the join barrier;
        then heartbeat, calling ``on_failure`` (from the heartbeat thread) when peers
        are found dead, and ``on_abandoned`` (why) when a peer left the generation
        after its group broke.

        Returns the store under the generation's prefix, kept open until :meth:`release`.
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
        store = generation_store(raw, world, s.join_token.get_secret_value().encode())
        self._stores = [raw, store]
        beats = self._beat_connection(world) if on_failure is not None else None
        join_barrier(store, rank, world.size, deadline=deadline, superseded=superseded,
                     clock=clock)
        if on_failure is not None:
            self._heartbeat = Heartbeat(
                lambda timeout_s: self._connect(world, timeout_s), world, rank,
                interval_s=s.heartbeat_interval_s, detect_s=s.failure_detect_s,
                on_failure=on_failure, on_abandoned=on_abandoned, on_lag=self._on_lag,
                clock=clock, store=beats)
            self._heartbeat.start()
        return store

    def _beat_connection(self, world: World) -> Store | None:
        """The heartbeat's own connection, opened before the barrier.

        Opened by the first beat, right after the barrier, it came when every member
        opens one at once while the library forms its group, and on a loaded machine
        a new connection to the store took seconds (the client's connect/validate
        timing out and retrying; the constructor can outlast its timeout): the first
        beats went out late or the request stayed unanswered for ``failure_detect_s``,
        and healthy members were named dead ("last beat 0", or the store's host for a
        store that "did not answer"). Before the barrier a slow connection only delays
        this member's arrival, which its peers wait for anyway. None when it fails: the
        first beat tries again.
        """
        s = self._settings
        try:
            return self._connect(world, request_timeout_s(s.failure_detect_s,
                                                          s.heartbeat_interval_s))
        except dist.DistError:
            return None

    def release(self, *, left_cleanly: bool = False) -> None:
        """Stop heartbeating and drop this generation's connections (the server, if hosted,
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

    def _connect(self, world: World, timeout_s: float) -> Store:
        at = world.store
        raw = TCPStore(at.address, at.port, None, False, timedelta(seconds=timeout_s),
                       wait_for_workers=False)
        return generation_store(raw, world, self._settings.join_token.get_secret_value().encode())
