"""Stall watchdog and readiness: the file and the HTTP endpoint follow the loop's progress."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path

from ringwright.runtime.membership.health import HealthFile, ReadinessServer, StallWatchdog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_ready_until_no_progress_for_the_timeout_then_ready_again_on_progress() -> None:
    clock = Clock()
    dog = StallWatchdog(10.0, clock=clock)
    changes: list[bool] = []
    dog.add_listener(lambda ready, idle: changes.append(ready))
    clock.now += 9
    assert dog.check()
    clock.now += 2
    assert not dog.check()
    dog.beat()
    assert dog.ready
    assert changes == [True, False, True]


def test_a_zero_timeout_disables_the_watchdog() -> None:
    clock = Clock()
    dog = StallWatchdog(0.0, clock=clock)
    clock.now += 1e6
    assert dog.check()


def test_the_health_file_exists_only_while_ready(tmp_path: Path) -> None:
    clock = Clock()
    path = tmp_path / "run" / "ready"
    dog = StallWatchdog(1.0, clock=clock)
    dog.add_listener(HealthFile(path))
    assert path.exists()
    clock.now += 2
    dog.check()
    assert not path.exists()
    dog.beat()
    assert path.exists()


def status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return err.code


def test_the_readiness_endpoint_fails_while_stalled() -> None:
    clock = Clock()
    dog = StallWatchdog(1.0, clock=clock)
    server = ReadinessServer(dog, 0, host="127.0.0.1")
    server.start()
    try:
        assert status(server.port, "/readyz") == 200
        clock.now += 5
        dog.check()
        assert status(server.port, "/readyz") == 503
        assert status(server.port, "/healthz") == 200
        assert status(server.port, "/other") == 404
    finally:
        server.stop()


def test_the_checker_thread_notices_a_stall_by_itself() -> None:
    dog = StallWatchdog(0.1)
    seen: list[bool] = []
    dog.add_listener(lambda ready, idle: seen.append(ready))
    dog.start(interval_s=0.02)
    try:
        deadline = time.monotonic() + 10
        while seen[-1] and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        dog.stop()
    assert seen[-1] is False


def test_a_busy_block_is_no_stall_and_the_timeout_restarts_on_leaving() -> None:
    clock = Clock()
    dog = StallWatchdog(10.0, clock=clock)
    clock.now += 11
    assert not dog.check(), "a loop that makes no progress is flagged"
    with dog.paused():
        assert dog.ready, "entering a busy block is a sign of life"
        clock.now += 1000
        assert dog.check(), "however long the block takes"
        with dog.paused():
            clock.now += 1000
        assert dog.check(), "an inner block's end does not end the outer one"
    clock.now += 9
    assert dog.check(), "the timeout counts from leaving the block"
    clock.now += 2
    assert not dog.check(), "and flags a stall after it again"
