"""Ports for the local cluster's servers come from below the kernel's ephemeral range:
one the kernel may give an outgoing connection's local end before the server binds it
is not free for long."""

from __future__ import annotations

import socket
from pathlib import Path

from ringwright.devcluster.control_plane import LISTEN_PORTS_FROM, free_port


def test_a_port_comes_from_below_the_ephemeral_range_and_a_taken_one_is_skipped(
        tmp_path: Path) -> None:
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy: int = taken.getsockname()[1]
        taken.listen()
        draws: list[int] = [busy, 23456]
        asked: list[tuple[int, int]] = []

        def pick(low: int, high: int) -> int:
            asked.append((low, high))
            return draws.pop(0)

        assert free_port(ranges, pick) == 23456
    assert asked == [(LISTEN_PORTS_FROM, 32768)] * 2


def test_without_room_below_the_range_the_kernel_picks(tmp_path: Path) -> None:
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("20500 60999\n")

    def pick(low: int, high: int) -> int:
        raise AssertionError("no draw below a range that starts this low")

    assert 0 < free_port(ranges, pick) < 65536
    assert 0 < free_port(tmp_path / "missing", pick) < 65536
