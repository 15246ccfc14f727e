"""Is a member alive? Heartbeats on the generation's store, apart from the collectives.

Every member of a generation runs a :class:`Heartbeat` from the join barrier until it
leaves the generation. Each beat bumps this member's counter on the generation's
store on a wall-clock tick shared by all members, and a moment later reads every
peer's counter in one request. :class:`LivenessTracker` (pure) decides who is dead:
a peer whose counter did not change for ``failure_detect_s``, or the store's host
(rank 0) when the store itself stopped answering for that long; the judge looks when
such a verdict falls due. A training loop that is merely slow keeps beating, since
the beat runs on its own thread, so it is never taken for dead.

A member that leaves a generation writes :data:`LEFT` (training done, a planned change)
or :data:`ABANDONED` (moving on after its group broke) so its peers do not mistake its
silence for death. Its group's connections close as it leaves, which as a rule fails
the collectives its peers still wait in; a rule with exceptions (a rank of a pod of
three once stayed in a gloo ``all_reduce`` for minutes while everyone else waited for
it in the next generation). So a peer that reads :data:`ABANDONED` aborts its own group
as well: no collective of the generation can complete any more.
"""

from __future__ import annotations

import atexit
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch.distributed as dist
from torch._C._distributed_c10d import Store

from ringwright.world import World

from ..kvlog import log_event, runtime_logger

_log = runtime_logger("liveness")

LEFT = -1
"""Counter value of a member that left the generation cleanly."""

ABANDONED = -2
"""Counter value of a member that left the generation after its group broke (it aborted
its own): alive, yet no collective of the generation can complete without it."""


def heartbeat_key(rank: int) -> str:
    """Key of ``rank``'s heartbeat counter under the generation's prefix."""
    return f"heartbeat/{rank}"


@dataclass(frozen=True)
class PeerFailure:
    """Members of a generation found dead by this member, and why."""

    generation: int
    pods: tuple[str, ...]
    evidence: str


@dataclass
class _Peer:
    value: int | None
    since: float
    left: bool = False
    abandoned: bool = False


class LivenessTracker:
    """Decides, from successive reads of the counters, which peers are dead."""

    def __init__(self, size: int, rank: int, detect_s: float, now: float) -> None:
        self._rank = rank
        self._detect_s = detect_s
        self._peers = {r: _Peer(None, now) for r in range(size) if r != rank}
        self._store_failing_since: float | None = None
        self._store_error = ""

    def observe(self, values: Mapping[int, int], now: float) -> None:
        """Record one successful read of the peers' counters at ``now``."""
        self._store_failing_since = None
        for rank, value in values.items():
            peer = self._peers.get(rank)
            if peer is None:
                continue
            if value in (LEFT, ABANDONED):
                peer.left = True
                peer.abandoned = value == ABANDONED
            elif value != peer.value:
                peer.value, peer.since = value, now

    def store_failed(self, now: float, error: str) -> None:
        """Record that the store did not answer at ``now``."""
        if self._store_failing_since is None:
            self._store_failing_since = now
        self._store_error = error

    def abandoned(self) -> list[int]:
        """Peers that left the generation after its group broke, by rank."""
        return [rank for rank, peer in self._peers.items() if peer.abandoned]

    def lag(self, now: float) -> float:
        """Seconds since the stalest peer still in the generation last beat (0 with none)."""
        return max((now - peer.since for peer in self._peers.values() if not peer.left),
                   default=0.0)

    def dead(self, now: float) -> dict[int, str]:
        """Dead peers by rank, with the evidence for each."""
        if self._store_failing_since is not None:
            # Without the store the counters are unknown, not stale: only its host is
            # judged.
            silent = now - self._store_failing_since
            if not self._host_judged() or silent < self._detect_s:
                return {}
            return {0: f"the store it hosts did not answer for {silent:.1f}s "
                       f"({self._store_error})"}
        return {
            rank: (f"no heartbeat for {now - peer.since:.1f}s"
                   + (f" (last beat {peer.value})" if peer.value is not None else ""))
            for rank, peer in self._peers.items()
            if not peer.left and now - peer.since >= self._detect_s
        }

    def _host_judged(self) -> bool:
        """Whether the store's host (rank 0) can be found dead while the store fails: a
        peer that left cleanly is expected to be silent."""
        host = self._peers.get(0)
        return host is not None and not host.left

    def due(self, now: float) -> float | None:
        """The next moment after ``now`` at which :meth:`dead` names someone new if
        nothing more is heard; None when no verdict is pending."""
        if self._store_failing_since is not None:
            at = self._store_failing_since + self._detect_s
            return at if self._host_judged() and at > now else None
        return min((peer.since + self._detect_s for peer in self._peers.values()
                    if not peer.left and peer.since + self._detect_s > now), default=None)


_abandoned: dict[threading.Thread, float] = {}
"""Beat threads that :meth:`Heartbeat.stop` left inside a store call, with how long
that call can last (a module-level registry: the process exit must find them all)."""
_abandoned_lock = threading.Lock()


def _finish_abandoned_beats() -> None:
    # A daemon thread still inside a c10d store call when the interpreter finalizes
    # ends in std::terminate (it unwinds through a noexcept destructor when it tries
    # to take the GIL back), so a fenced member would die with SIGABRT instead of its
    # exit status. At exit, before finalization, let each such call run out.
    with _abandoned_lock:
        pending = list(_abandoned.items())
        _abandoned.clear()
    for thread, bound_s in pending:
        thread.join(timeout=bound_s)
        if thread.is_alive():
            log_event(_log, logging.WARNING, "heartbeat_call_outlived_exit",
                      thread=thread.name, waited_s=bound_s)


atexit.register(_finish_abandoned_beats)


StoreFactory = Callable[[float], Store]
"""Opens a new connection to the generation's store (under its prefix) with a timeout."""

LagListener = Callable[[float], None]
"""Told, on every pass of the judge, :meth:`LivenessTracker.lag` in seconds."""


def until_next_beat(wall: float, interval_s: float) -> float:
    """Seconds from wall-clock time ``wall`` to the next multiple of ``interval_s``.

    Every member beats on the same wall-clock ticks and reads its peers' counters a
    moment later (:func:`read_delay`), so each reads every peer's newest beat in the
    same tick and all find a silent member dead together, as soon as its last beat is
    ``failure_detect_s`` old. Beating at its own phase, a member read a peer's beat up
    to a whole interval after it was made and named the peer that much later; the
    second member to do so (the one an eviction waits for) came a random part of an
    interval after the first. Clocks that disagree only bring that back: a late
    reader sees a beat one tick later, never earlier than it was made.
    """
    return interval_s - math.fmod(wall, interval_s)


def read_delay(interval_s: float) -> float:
    """How long after a tick a member reads its peers' counters: long enough for the
    beats of that tick to reach the store (clock skew plus a request's latency)."""
    return min(interval_s / 5, 0.1)


def request_timeout_s(detect_s: float, interval_s: float) -> float:
    """Timeout of the heartbeat's connection and of each of its requests."""
    return max(detect_s / 3, interval_s)


class Heartbeat:
    """Beats for this member and watches its peers, on two daemon threads.

    One thread talks to the store; the other judges. A store request to a frozen
    host may block far beyond its timeout (the client retries), so the judge counts
    a request left unanswered for ``failure_detect_s`` as the store failing.

    ``store``: the heartbeat's connection, opened beforehand (see
    :meth:`~ringwright.runtime.membership.generation_store.GenerationStores.meet`);
    None: the first beat opens it, and opens it again after a failed request.
    """

    def __init__(
        self,
        connect: StoreFactory,
        world: World,
        rank: int,
        *,
        interval_s: float,
        detect_s: float,
        on_failure: Callable[[PeerFailure], None],
        on_abandoned: Callable[[str], None] | None = None,
        on_lag: LagListener | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        store: Store | None = None,
    ) -> None:
        self._connect = connect
        self._world = world
        self._rank = rank
        self._interval = interval_s
        self._detect_s = detect_s
        self._on_failure = on_failure
        self._on_abandoned = on_abandoned
        self._on_lag = on_lag
        self._clock = clock
        self._wall = wall_clock
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._tracker = LivenessTracker(world.size, rank, detect_s, clock())
        self._asking_since: float | None = None
        self._store: Store | None = store
        self._threads = [
            threading.Thread(target=self._beat, daemon=True,
                             name=f"ringwright-heartbeat-{world.generation}"),
            threading.Thread(target=self._judge, daemon=True,
                             name=f"ringwright-liveness-{world.generation}"),
        ]

    def start(self) -> None:
        """Begin beating and watching."""
        for thread in self._threads:
            thread.start()

    def stop(self, *, left_cleanly: bool) -> None:
        """Stop, and tell the peers this silence is not a death: over the heartbeat's
        own connection when it is idle (a member moving on after a failure is alive,
        and its peers still in this generation must not name it), or over a new one when
        ``left_cleanly`` (the store is then known to be healthy). Not ``left_cleanly``:
        the group broke, and the mark (:data:`ABANDONED`) has the peers abort theirs."""
        self._stop.set()
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                # A beat blocked on a frozen store host is abandoned (a daemon thread);
                # the next generation must not wait for it, only the process exit does.
                thread.join(timeout=self._interval)
        beat = self._threads[0]
        if beat.is_alive():
            with _abandoned_lock:
                # A beat is at most a connect, a set and a multi_get, each bounded.
                _abandoned[beat] = 3 * self._timeout() + self._interval
        store = None if self._threads[0].is_alive() else self._store
        try:
            if store is None and left_cleanly:
                store = self._connect(self._timeout())
            if store is not None:
                store.set(heartbeat_key(self._rank), str(LEFT if left_cleanly else ABANDONED))
        except (dist.DistError, RuntimeError) as err:
            log_event(_log, logging.INFO, "leave_mark_not_written", error=err)
        self._store = None

    def _timeout(self) -> float:
        return request_timeout_s(self._detect_s, self._interval)

    def _beat(self) -> None:
        peers = [r for r in range(self._world.size) if r != self._rank]
        keys = [heartbeat_key(r) for r in peers]
        beat = 0

        def write(store: Store) -> None:
            store.set(heartbeat_key(self._rank), str(beat))

        def read(store: Store) -> None:
            values = store.multi_get(keys) if keys else []
            with self._lock:
                self._tracker.observe(
                    {r: int(v) for r, v in zip(peers, values, strict=True)}, self._clock())

        while not self._stop.wait(until_next_beat(self._wall(), self._interval)):
            beat += 1
            if self._ask(write) and not self._stop.wait(read_delay(self._interval)):
                self._ask(read)

    def _ask(self, request: Callable[[Store], None]) -> bool:
        """One request on the heartbeat's connection; a failure counts against the store."""
        with self._lock:
            self._asking_since = self._clock()
        try:
            if self._store is None:
                self._store = self._connect(self._timeout())
            request(self._store)
            return True
        except (dist.DistError, RuntimeError, ValueError) as err:
            self._store = None
            with self._lock:
                self._tracker.store_failed(self._clock(), str(err).splitlines()[0][:200])
            return False
        finally:
            with self._lock:
                self._asking_since = None

    def _judge(self) -> None:
        known: set[int] = set()
        told_abandoned = False
        while not self._stop.wait(self._next_wait()):
            now = self._clock()
            with self._lock:
                asking = self._asking_since
                if asking is not None and now - asking >= self._timeout():
                    self._tracker.store_failed(asking, f"no answer for {now - asking:.1f}s")
                dead = self._tracker.dead(now)
                lag = self._tracker.lag(now)
                abandoned = self._tracker.abandoned()
            if self._on_lag is not None:
                self._on_lag(lag)
            if dead.keys() - known and not self._stop.is_set():
                known |= dead.keys()
                self._on_failure(self._failure(dead))
            if abandoned and not told_abandoned and self._on_abandoned is not None \
                    and not self._stop.is_set():
                told_abandoned = True
                self._on_abandoned(self._abandoned(abandoned))

    def _next_wait(self) -> float:
        """Until the next verdict falls due, at most an interval (judging once per
        interval, in step with the beats, named the dead an interval late)."""
        now = self._clock()
        with self._lock:
            due = self._tracker.due(now)
            asking = self._asking_since
        if asking is not None and asking + self._detect_s > now:
            # A request left unanswered condemns the store's host at this moment.
            due = asking + self._detect_s if due is None else min(due, asking + self._detect_s)
        return self._interval if due is None else min(self._interval, due - now)

    def _abandoned(self, ranks: list[int]) -> str:
        members = self._world.members
        why = (", ".join(f"{members[r].pod} (rank {r})" for r in ranks)
               + " left the generation after its group broke")
        log_event(_log, logging.WARNING, "group_abandoned", generation=self._world.generation,
                  by=",".join(str(r) for r in ranks))
        return why

    def _failure(self, dead: dict[int, str]) -> PeerFailure:
        members = self._world.members
        evidence = "; ".join(f"{members[r].pod} (rank {r}): {why}"
                             for r, why in sorted(dead.items()))
        # Suspects are pods: several dead local ranks of one pod name it once.
        pods = tuple(dict.fromkeys(members[r].pod for r in sorted(dead)))
        log_event(_log, logging.WARNING, "peers_dead", generation=self._world.generation,
                  pods=",".join(pods), evidence=evidence)
        return PeerFailure(self._world.generation, pods, evidence)
