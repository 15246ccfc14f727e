"""Point-to-point transfers over TCP, and the alpha + beta·l fit of their times.

A message of ``l`` bytes costs alpha + beta·l: alpha the latency, beta the time per byte (the
inverse of the bandwidth). The prober sends messages of several sizes to an echo
server that answers each with one byte once it has all of it, and times the round;
the ack adds one more latency, so the fit of the round times has intercept 2 alpha and
slope beta.

    python -m ringwright.devcluster.netprobe serve PORT
    python -m ringwright.devcluster.netprobe send ADDRESS PORT REPEATS SIZE...   # JSON
"""

from __future__ import annotations

import json
import socket
import statistics
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

_HEADER = struct.Struct("!Q")
_CHUNK = 1 << 16


@dataclass(frozen=True)
class AlphaBeta:
    """The fitted cost model of one path."""

    alpha_s: float
    """Latency of one message, seconds."""
    beta_s_per_byte: float
    """Seconds per byte."""

    @property
    def mbit_per_s(self) -> float:
        """The bandwidth 1/beta, in Mbit/s."""
        return 8 / self.beta_s_per_byte / 1e6 if self.beta_s_per_byte > 0 else float("inf")


def fit_alpha_beta(samples: Sequence[tuple[int, float]]) -> AlphaBeta:
    """Fit round times ``(bytes, seconds)`` to 2 alpha + beta*l.

    beta is the least-squares slope (the large messages decide it); alpha comes from
    the smallest message, whose time is almost all latency. A shaper's burst lets small
    messages through at link speed, so a single straight line through all sizes would
    misplace the intercept.
    """
    if len({size for size, _ in samples}) < 2:
        raise ValueError("the fit needs round times for at least two message sizes")
    n = len(samples)
    mean_l = sum(size for size, _ in samples) / n
    mean_t = sum(t for _, t in samples) / n
    cov = sum((size - mean_l) * (t - mean_t) for size, t in samples)
    var = sum((size - mean_l) ** 2 for size, _ in samples)
    beta = cov / var
    size, t = min(samples)
    return AlphaBeta(alpha_s=max(t - beta * size, 0.0) / 2, beta_s_per_byte=beta)


def _recv_exactly(conn: socket.socket, n: int) -> None:
    left = n
    while left:
        chunk = conn.recv(min(left, _CHUNK))
        if not chunk:
            raise ConnectionError("peer closed mid-message")
        left -= len(chunk)


def serve(port: int, address: str = "0.0.0.0") -> None:
    """Answer each message of one client with one byte; return when it sends size 0."""
    with socket.create_server((address, port)) as server:
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                header = bytearray()
                while len(header) < _HEADER.size:
                    part = conn.recv(_HEADER.size - len(header))
                    if not part:
                        return
                    header += part
                (size,) = _HEADER.unpack(header)
                if size == 0:
                    return
                _recv_exactly(conn, size)
                conn.sendall(b"k")


def round_times(address: str, port: int, sizes: Sequence[int], repeats: int,
                connect_timeout_s: float = 30.0) -> list[tuple[int, float]]:
    """Median round time of ``repeats`` messages of every size, after one warm-up."""
    deadline = time.monotonic() + connect_timeout_s
    while True:
        try:
            conn = socket.create_connection((address, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    results = []
    with conn:
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for size in sizes:
            payload = bytes(size)
            times = []
            for i in range(repeats + 1):
                started = time.perf_counter()
                conn.sendall(_HEADER.pack(size) + payload)
                _recv_exactly(conn, 1)
                if i:
                    times.append(time.perf_counter() - started)
            results.append((size, statistics.median(times)))
        conn.sendall(_HEADER.pack(0))
    return results


def main(argv: Sequence[str]) -> int:
    """``serve PORT`` or ``send ADDRESS PORT REPEATS SIZE...`` (prints JSON)."""
    if argv[:1] == ["serve"] and len(argv) == 2:
        serve(int(argv[1]))
        return 0
    if argv[:1] == ["send"] and len(argv) >= 5:
        sizes = [int(s) for s in argv[4:]]
        print(json.dumps(round_times(argv[1], int(argv[2]), sizes, int(argv[3]))))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
