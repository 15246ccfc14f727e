"""Liveness: the pure tracker, the heartbeat on a real store, aborting by socket shutdown."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from ringwright.runtime.collectives.sockets import GroupSockets
from ringwright.runtime.local.launcher import free_port
from ringwright.runtime.membership.liveness import (
    ABANDONED,
    LEFT,
    Heartbeat,
    LivenessTracker,
    PeerFailure,
    heartbeat_key,
    read_delay,
    until_next_beat,
)
from ringwright.world import JobRef, Member, StoreAddress, World


def test_a_peer_silent_for_the_detection_time_is_dead_with_evidence() -> None:
    t = LivenessTracker(size=3, rank=0, detect_s=3.0, now=0.0)
    t.observe({1: 1, 2: 1}, now=0.5)
    t.observe({1: 2, 2: 1}, now=2.0)
    assert t.dead(3.4) == {}
    t.observe({1: 3, 2: 1}, now=3.5)
    dead = t.dead(3.5)
    assert list(dead) == [2] and "no heartbeat for 3.0s" in dead[2]


def test_late_beats_are_still_beats() -> None:
    """A slow member beats from its own thread: only silence counts, not lateness."""
    t = LivenessTracker(size=2, rank=1, detect_s=3.0, now=0.0)
    for now in (2.9, 5.8, 8.7, 11.6):
        t.observe({0: int(now * 10)}, now=now)
        assert t.dead(now + 2.9) == {}


def test_a_member_that_left_cleanly_is_not_dead() -> None:
    t = LivenessTracker(size=2, rank=0, detect_s=1.0, now=0.0)
    t.observe({1: LEFT}, now=0.1)
    assert t.dead(100.0) == {}


def test_a_member_that_moved_on_after_its_group_broke_is_not_dead_but_named() -> None:
    t = LivenessTracker(size=3, rank=0, detect_s=1.0, now=0.0)
    t.observe({1: ABANDONED, 2: LEFT}, now=0.1)
    assert t.dead(100.0) == {}
    assert t.abandoned() == [1]


def test_a_store_that_stops_answering_condemns_its_host_only() -> None:
    t = LivenessTracker(size=3, rank=2, detect_s=3.0, now=0.0)
    t.observe({0: 1, 1: 1}, now=0.5)
    t.store_failed(1.0, "timed out")
    assert t.dead(3.9) == {}, "counters are unknown while the store is down, not stale"
    dead = t.dead(4.0)
    assert list(dead) == [0] and "did not answer" in dead[0]
    t.observe({0: 2, 1: 2}, now=4.5)
    assert t.dead(4.5) == {}


def test_lag_is_the_stalest_peer_still_in_the_generation() -> None:
    t = LivenessTracker(size=4, rank=0, detect_s=3.0, now=0.0)
    t.observe({1: 1, 2: 1, 3: 1}, now=1.0)
    t.observe({1: 2, 2: 1, 3: 2}, now=2.5)
    assert t.lag(3.0) == 2.0, "rank 2 last beat at 1.0"
    t.observe({1: 3, 2: LEFT, 3: 3}, now=4.0)
    assert t.lag(4.5) == 0.5, "a member that left is not stale"
    t.store_failed(5.0, "timed out")
    assert t.lag(6.0) == 2.0, "without the store, beats age"
    assert LivenessTracker(size=1, rank=0, detect_s=1.0, now=0.0).lag(9.0) == 0.0


def test_a_store_gone_after_its_host_left_cleanly_is_expected() -> None:
    t = LivenessTracker(size=2, rank=1, detect_s=1.0, now=0.0)
    t.observe({0: LEFT}, now=0.1)
    t.store_failed(0.2, "connection refused")
    assert t.dead(10.0) == {}


def test_the_next_verdict_falls_due_when_the_stalest_peer_reaches_the_detection_time() -> None:
    t = LivenessTracker(size=4, rank=3, detect_s=3.0, now=0.0)
    assert t.due(0.0) == 3.0
    t.observe({0: 1, 1: 1, 2: 1}, now=0.5)
    t.observe({0: 2, 1: 1, 2: LEFT}, now=1.0)
    assert t.due(1.0) == 3.5, "rank 1 last beat at 0.5; rank 2 left"
    assert t.dead(3.4) == {} and list(t.dead(3.5)) == [1]
    assert t.due(3.5) == 4.0, "rank 1 is judged already: rank 0 is next"
    t.store_failed(4.2, "timed out")
    assert t.due(4.5) == 7.2, "without the store only its host is judged"
    assert t.due(7.2) is None
    alone = LivenessTracker(size=2, rank=0, detect_s=1.0, now=0.0)
    alone.observe({1: LEFT}, now=0.1)
    assert alone.due(0.1) is None


@pytest.mark.parametrize(("wall", "interval", "wait"), [
    (100.0, 0.5, 0.5), (100.1, 0.5, 0.4), (100.49, 0.5, 0.01), (7.25, 1.0, 0.75),
])
def test_every_member_beats_on_the_same_wall_clock_ticks(
        wall: float, interval: float, wait: float) -> None:
    """Members started at different moments still beat (and read a moment later)
    together, so they all hear a peer's last beat in the same tick."""
    assert until_next_beat(wall, interval) == pytest.approx(wait)
    assert 0 < read_delay(interval) < interval / 2
    assert read_delay(0.5) == pytest.approx(0.1) and read_delay(5.0) == pytest.approx(0.1)


def world(size: int, port: int) -> World:
    members = tuple(Member(rank=i, pod=f"w{i}", ip="127.0.0.1") for i in range(size))
    return World(job=JobRef(namespace="n", name="j"), generation=5, members=members,
                 store=StoreAddress(address="127.0.0.1", port=port))


@pytest.fixture()
def server() -> Iterator[TCPStore]:
    yield TCPStore("127.0.0.1", free_port(), None, True, timedelta(seconds=5),
                   wait_for_workers=False)


def beats_on(server: TCPStore, size: int) -> tuple[Callable[[float], Store], Store]:
    """A connection factory to ``server`` under a generation's prefix, and the prefixed
    server itself, with every rank's counter at 0 (as after the join barrier)."""

    def connect(timeout_s: float) -> Store:
        raw = TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=timeout_s),
                       wait_for_workers=False)
        return PrefixStore("e/", raw)

    prefixed = PrefixStore("e/", server)
    for rank in range(size):
        prefixed.set(heartbeat_key(rank), "0")
    return connect, prefixed


def test_heartbeats_on_a_real_store_find_the_silent_member(server: TCPStore) -> None:
    w = world(3, server.port)
    connect, prefixed = beats_on(server, 3)
    failures: list[PeerFailure] = []
    found = threading.Event()

    def on_failure(f: PeerFailure) -> None:
        failures.append(f)
        found.set()

    lags: list[float] = []
    beats = [Heartbeat(connect, w, rank, interval_s=0.05, detect_s=0.6, on_failure=on_failure,
                       on_lag=lags.append if rank == 0 else None)
             for rank in (0, 1)]
    for b in beats:
        b.start()
    try:
        # Rank 2 never beats; ranks 0 and 1 keep each other alive.
        assert found.wait(10)
        time.sleep(0.3)
    finally:
        for b in beats:
            b.stop(left_cleanly=True)
    assert {f.pods for f in failures} == {("w2",)}
    assert all(f.generation == 5 and "w2 (rank 2): no heartbeat" in f.evidence for f in failures)
    assert prefixed.get(heartbeat_key(0)) == str(LEFT).encode()
    assert max(lags) >= 0.6, "the judge reports the silent member's lag"


@pytest.mark.parametrize("left_cleanly", [False, True])
def test_a_peer_that_moved_on_after_its_group_broke_has_the_others_abort(
        server: TCPStore, left_cleanly: bool) -> None:
    """Its closed connections do not always fail a collective still waiting on it: the
    mark it leaves does, through the peers' heartbeats. A clean leave aborts nobody."""
    w = world(2, server.port)
    connect, prefixed = beats_on(server, 2)
    failures: list[PeerFailure] = []
    abandoned: list[str] = []
    told = threading.Event()

    def on_abandoned(why: str) -> None:
        abandoned.append(why)
        told.set()

    stays = Heartbeat(connect, w, 0, interval_s=0.05, detect_s=5.0, on_failure=failures.append,
                      on_abandoned=on_abandoned)
    leaves = Heartbeat(connect, w, 1, interval_s=0.05, detect_s=5.0,
                       on_failure=failures.append)
    stays.start()
    leaves.start()
    try:
        time.sleep(0.3)
        leaves.stop(left_cleanly=left_cleanly)
        assert told.wait(3) is not left_cleanly
    finally:
        stays.stop(left_cleanly=True)
    assert failures == [], "a member that moved on is alive"
    expected = [] if left_cleanly else ["w1 (rank 1) left the generation after its group broke"]
    assert abandoned == expected
    assert prefixed.get(heartbeat_key(1)) == str(LEFT if left_cleanly else ABANDONED).encode()


def test_the_judge_names_the_dead_when_due_not_at_its_next_tick(server: TCPStore) -> None:
    """Beats and judging every 10 s: a member silent since the start is named at its
    1 s deadline, not at the judge's first tick."""
    w = world(2, server.port)
    PrefixStore("e/", server).set(heartbeat_key(1), "0")

    def connect(timeout_s: float) -> Store:
        return PrefixStore("e/", TCPStore("127.0.0.1", server.port, None, False,
                                          timedelta(seconds=timeout_s), wait_for_workers=False))

    found = threading.Event()
    beat = Heartbeat(connect, w, 0, interval_s=10.0, detect_s=1.0,
                     on_failure=lambda f: found.set())
    beat.start()
    try:
        assert found.wait(8.0), "the verdict waited for the judge's next tick"
    finally:
        beat.stop(left_cleanly=False)


def first_beat(prefixed: Store, within_s: float) -> bool:
    """Whether rank 0 replaced its "0" beat within ``within_s``."""
    deadline = time.monotonic() + within_s
    while prefixed.get(heartbeat_key(0)) == b"0" and time.monotonic() < deadline:
        time.sleep(0.02)
    return prefixed.get(heartbeat_key(0)) != b"0"


def test_a_member_beats_at_the_wall_clock_tick_not_an_interval_after_it_started(
        server: TCPStore) -> None:
    """Started 9.95 s into a 10 s tick, the first beat goes out 0.05 s later."""
    w = world(2, server.port)
    prefixed = PrefixStore("e/", server)
    for rank in range(2):
        prefixed.set(heartbeat_key(rank), "0")

    def connect(timeout_s: float) -> Store:
        return PrefixStore("e/", TCPStore("127.0.0.1", server.port, None, False,
                                          timedelta(seconds=timeout_s), wait_for_workers=False))

    beat = Heartbeat(connect, w, 0, interval_s=10.0, detect_s=60.0,
                     on_failure=lambda f: None, wall_clock=lambda: 9.95)
    beat.start()
    try:
        assert first_beat(prefixed, within_s=8.0), "the beat waited a whole interval"
    finally:
        beat.stop(left_cleanly=False)


def test_abort_shuts_down_only_the_connections_opened_while_forming() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    keep = socket.create_connection(("127.0.0.1", port))
    sockets = GroupSockets(keep_ports=set())
    group = socket.create_connection(("127.0.0.1", port))
    group_peer, _ = listener.accept()
    sockets.formed()
    later = socket.create_connection(("127.0.0.1", port))
    try:
        # The group's connection reads end-of-file at once: a blocked receive returns.
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(group.recv(1)))
        reader.start()
        assert sockets.abort() >= 1
        reader.join(5)
        assert got == [b""]
        for untouched in (keep, later):
            untouched.sendall(b"x")  # would raise on a shut-down socket
    finally:
        for s in (listener, keep, group, group_peer, later):
            s.close()


def test_a_heartbeat_given_its_connection_beats_on_it_without_connecting(
        server: TCPStore) -> None:
    """The connection opened before the barrier carries the beats from the first one:
    a new connection right after the barrier, when every member opens one while the
    library forms its group, took seconds on a loaded machine."""
    w = world(2, server.port)
    prefixed = PrefixStore("e/", server)
    for rank in range(2):
        prefixed.set(heartbeat_key(rank), "0")
    opened = PrefixStore("e/", TCPStore("127.0.0.1", server.port, None, False,
                                        timedelta(seconds=5), wait_for_workers=False))
    connects: list[float] = []

    def connect(timeout_s: float) -> Store:
        connects.append(timeout_s)
        raise RuntimeError("no new connection in this test")

    beat = Heartbeat(connect, w, 0, interval_s=0.05, detect_s=60.0,
                     on_failure=lambda f: None, store=opened)
    beat.start()
    try:
        assert first_beat(prefixed, within_s=8.0), "no beat on the given connection"
    finally:
        beat.stop(left_cleanly=False)
    assert connects == []
