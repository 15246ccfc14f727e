"""The local file membership source: atomic publication, newer generations only, bad
documents never replace a good world."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from ringwright.runtime.membership.file_source import FileMembershipSource, write_world_file
from ringwright.runtime.membership.source import WorldBox, WorldTimeout
from ringwright.world import JobRef, Member, StoreAddress, World


def world(generation: int, size: int = 2) -> World:
    members = tuple(Member(rank=i, pod=f"w-{i}", ip=f"127.0.0.{10 + i}") for i in range(size))
    return World(job=JobRef(namespace="local", name="j"), generation=generation, members=members,
                 store=StoreAddress(address="127.0.0.10", port=29400))


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_no_file_means_no_world_yet(tmp_path: Path) -> None:
    t = FakeTime()
    src = FileMembershipSource(tmp_path / "world.json", clock=t.clock, sleep=t.sleep)
    assert src.latest() is None
    with pytest.raises(WorldTimeout, match="no world newer than generation -1"):
        src.wait_for_world(-1, timeout=1.0)
    assert t.now >= 1.0


def test_a_published_world_is_read_back_and_written_atomically(tmp_path: Path) -> None:
    path = tmp_path / "world.json"
    write_world_file(path, world(0))
    write_world_file(path, world(1, size=3))
    assert [p.name for p in tmp_path.iterdir()] == ["world.json"]
    got = FileMembershipSource(path).wait_for_world(0, timeout=1.0)
    assert (got.generation, got.size) == (1, 3)


def test_older_or_equal_generations_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "world.json"
    src = FileMembershipSource(path)
    write_world_file(path, world(5))
    assert src.latest() == world(5)
    write_world_file(path, world(4, size=3))
    latest = src.latest()
    assert latest is not None and (latest.generation, latest.size) == (5, 2)


def test_an_invalid_document_keeps_the_last_good_world(tmp_path: Path) -> None:
    path = tmp_path / "world.json"
    src = FileMembershipSource(path)
    write_world_file(path, world(2))
    assert src.latest() == world(2)
    path.write_text('{"schemaVersion": 99, "generation": 3}')
    assert src.latest() == world(2)
    write_world_file(path, world(3))
    assert src.latest() == world(3)


def test_waiting_returns_as_soon_as_a_newer_world_appears(tmp_path: Path) -> None:
    path = tmp_path / "world.json"
    write_world_file(path, world(0))
    src = FileMembershipSource(path, poll_interval=0.01)
    timer = threading.Timer(0.1, write_world_file, args=(path, world(1)))
    timer.start()
    try:
        assert src.wait_for_world(0, timeout=10.0).generation == 1
    finally:
        timer.cancel()


def test_the_world_box_wakes_waiters_and_times_out() -> None:
    box = WorldBox()
    threading.Timer(0.05, box.offer, args=(world(3), "test")).start()
    assert box.wait_newer(2, timeout=10.0).generation == 3
    assert not box.offer(world(3), "test")
    with pytest.raises(WorldTimeout):
        box.wait_newer(3, timeout=0.05)
