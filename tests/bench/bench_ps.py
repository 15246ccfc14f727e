"""Benchmark: parameter-server mode, each figure against a baseline from the same run.

* throughput of async vs sync training of the wide-and-deep example (2 PS, 4 workers,
  one worker 3x slower than the others), with the staleness and drop histograms;
* dense push + pull of a 100 MB model through the PS data plane (ZeroMQ frames that
  are the tensors' memory), as a fraction of raw loopback TCP bandwidth (one process
  sends 100 MB to another and reads it back), measured turn about in one run;
* latency of a sparse pull of 4,096 rows x 64 dims (median, goal <= 2 ms), against a
  raw TCP round trip of the same bytes;
* PS failover: from SIGKILL of a PS to the first update after it, against the normal
  step interval;
* resize: servers 2 -> 3 -> 2 under training; per moved shard, how long it had no
  primary, how much longer than the median step the workers' step around the move
  took, and how much longer their steps took in all before it (whole copies seeding the
  new home) and after it (whole copies seeding new replicas, a server ending);
* accuracy per wall-clock minute: held-out loss and AUC reached by sync, sync with a
  backup worker and async with tau = 2, 8, 32, one worker 3x slower (``ps_accuracy``),
  with a plot;
* skew: the hottest server's load over the mean with Zipf(1.1) ids on a 10,000,000-row
  table (``ps_skew``), against the same ids without de-duplication and with contiguous
  id ranges.

Run: ``python tests/bench/bench_ps.py``
(``--only throughput,dense,sparse,failover,resize,accuracy,skew``).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ringwright.runtime.ps.env import PSEnv  # noqa: E402
from ringwright.runtime.ps.memory import retain_freed_memory  # noqa: E402
from ringwright.runtime.ps.partition import Kind, TensorSpec  # noqa: E402
from ringwright.runtime.ps.serving.consistency import Consistency, Mode  # noqa: E402
from ringwright.runtime.ps.serving.hosting import JobConfig  # noqa: E402
from ringwright.runtime.ps.serving.optim import ServerOptimizer  # noqa: E402
from ringwright.runtime.ps.wire.client import PSClient  # noqa: E402
from tests.bench.ps_accuracy import bench_accuracy  # noqa: E402
from tests.bench.ps_skew import bench_skew  # noqa: E402
from tests.ps.harness import (  # noqa: E402
    LocalPSJob,
    consistency,
    free_port,
    moved,
    ps_done,
    step_overrun,
)

MB = 1_000_000
SERVER = """
import sys, time
import os, torch
from ringwright.runtime.ps.memory import retain_freed_memory
torch.set_num_threads(len(os.sched_getaffinity(0)))  # as a PS pod: its CPUs (process.py)
from ringwright.runtime.ps.serving.server import ParameterServer
from ringwright.runtime.ps.wire.transport import serve
retain_freed_memory()  # as a PS pod does
server = serve(ParameterServer(0), sys.argv[1])
time.sleep(3600)
"""
# The baseline gets what the PS side gets: buffers allocated once and reused, holding
# real data (a fresh bytes(n) maps the shared zero page: reading it is not reading memory).
ECHO = """
import socket, sys
buffers = {}
def buffer(n):
    if n not in buffers:
        buffers[n] = bytearray(b"\\x5a" * n)
    return buffers[n]
with socket.create_server(("127.0.0.1", int(sys.argv[1]))) as srv:
    while True:
        conn, _ = srv.accept()
        with conn:
            while True:
                head = conn.recv(8, socket.MSG_WAITALL)
                if len(head) < 8:
                    break
                want, reply = int.from_bytes(head[:4], "little"), int.from_bytes(head[4:], "little")
                mv, got = memoryview(buffer(want)), 0
                while got < want:
                    got += conn.recv_into(mv[got:], want - got)
                conn.sendall(buffer(reply))
"""


@contextmanager
def process(code: str, *args: str) -> Iterator[None]:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd="/")
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def wait_port(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {port}")


@contextmanager
def tcp_echo() -> Iterator[Callable[[int, int], float]]:
    """A raw TCP connection to another process; the function it gives sends ``send``
    bytes, reads ``receive`` back and returns the seconds that took."""
    port = free_port()
    with process(ECHO, str(port)):
        wait_port(port)
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            payloads: dict[int, bytes] = {}
            buffers: dict[int, bytearray] = {}

            def round_trip(send: int, receive: int) -> float:
                payload = payloads.setdefault(send, b"\x5a" * send)
                buf = buffers.setdefault(receive, bytearray(receive))
                start = time.perf_counter()
                conn.sendall(send.to_bytes(4, "little") + receive.to_bytes(4, "little"))
                conn.sendall(payload)
                mv, got = memoryview(buf), 0
                while got < receive:
                    got += conn.recv_into(mv[got:], receive - got)
                return time.perf_counter() - start

            yield round_trip


def tcp_round_trip(send: int, receive: int, repeats: int) -> list[float]:
    """Seconds to send ``send`` bytes to another process and read ``receive`` back."""
    with tcp_echo() as trip:
        return [trip(send, receive) for _ in range(repeats)]


def ps_client(specs: list[TensorSpec], params: dict[str, torch.Tensor],
              port: int) -> PSClient:
    client = PSClient([f"127.0.0.1:{port}"], "bench", call_timeout=600)
    client.wait_ready(60)
    config = JobConfig(tuple(specs), 1, ServerOptimizer(lr=1e-6), Consistency(Mode.ASYNC, 10**9),
                       {"samples": 1, "pieceSize": 1, "epochs": 1})
    client.initialize(config, params)
    return client


def bench_dense(repeats: int) -> dict[str, float]:
    numel = 100 * MB // 4
    port = free_port()
    # Turn about, PS then TCP: a slow spell of the machine falls on both sides.
    with process(SERVER, f"127.0.0.1:{port}"), tcp_echo() as trip:
        wait_port(port)
        client = ps_client([TensorSpec("w", (numel,))], {"w": torch.randn(numel)}, port)
        model = {"w": torch.empty(numel)}  # a worker pulls into its model's parameters
        times, tcp = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            pulled = client.pull({}, into=model)
            client.push(pulled.dense, {}, pulled.versions)
            times.append(time.perf_counter() - start)
            tcp.append(trip(100 * MB, 100 * MB))
        client.close()
    ps_s, tcp_s = statistics.median(times), statistics.median(tcp)
    print(f"dense 100 MB pull+push: {ps_s:.3f} s = {200 / ps_s:.0f} MB/s; raw TCP 100 MB "
          f"there and back: {tcp_s:.3f} s = {200 / tcp_s:.0f} MB/s; "
          f"PS / TCP bandwidth = {tcp_s / ps_s:.2f} (goal >= 0.70)")
    return {"dense_s": ps_s, "tcp_s": tcp_s, "fraction": tcp_s / ps_s}


def bench_sparse(repeats: int) -> dict[str, float]:
    rows, dim, want = 200_000, 64, 4096
    port = free_port()
    with process(SERVER, f"127.0.0.1:{port}"):
        wait_port(port)
        spec = TensorSpec("t", (rows, dim), kind=Kind.EMBEDDING)
        client = ps_client([spec], {"t": torch.randn(rows, dim)}, port)
        g = torch.Generator().manual_seed(0)
        times = []
        for _ in range(repeats):
            ids = torch.randperm(rows, generator=g)[:want]
            start = time.perf_counter()
            pulled = client.pull({"t": ids}, dense=False)
            times.append(time.perf_counter() - start)
            assert pulled.rows["t"][1].shape == (want, dim)
        client.close()
    tcp = tcp_round_trip(want * 8, want * dim * 4, repeats)
    ps_ms, tcp_ms = statistics.median(times) * 1e3, statistics.median(tcp) * 1e3
    print(f"sparse pull {want} x {dim}: median {ps_ms:.2f} ms (goal <= 2 ms; p90 "
          f"{sorted(times)[int(0.9 * len(times))] * 1e3:.2f} ms); raw TCP round trip of the "
          f"same bytes {tcp_ms:.2f} ms; ratio {ps_ms / tcp_ms:.1f}x")
    return {"sparse_ms": ps_ms, "tcp_ms": tcp_ms}


def _slowdown(job: LocalPSJob, workers: list[str]) -> float:
    """The last worker's median step interval over the others' (how much slower it is)."""
    def interval(w: str) -> float:
        return float(statistics.median(
            float(b["t"]) - float(a["t"]) for a, b in itertools.pairwise(job.steps(w))))

    return interval(workers[-1]) / statistics.median(interval(w) for w in workers[:-1])


def _throughput(job: LocalPSJob, workers: list[str]) -> tuple[float, int]:
    steps = [s for w in workers for s in job.steps(w)]
    trained = sum(s["samples"] for s in steps if not s["dropped"])
    span = max(s["t"] for s in steps) - min(s["t"] for s in steps)
    return trained / span, sum(1 for s in steps if s["dropped"])


def bench_throughput(root: Path) -> dict[str, float]:
    base = ["--samples", "6144", "--vocab", "5000", "--dim", "16", "--batch-size", "64",
            "--piece-batches", "4", "--epochs", "1", "--optimizer", "adagrad", "--slow", "0.03"]
    workers = ["w0", "w1", "w2", "w3"]
    results: dict[str, float] = {}
    for name, spec in (("sync", consistency("Sync")),
                       ("sync, 1 backup worker", consistency("Sync", backup_workers=1)),
                       ("async tau=8", consistency("Async", tau=8))):
        folder = root / name.replace(" ", "_").replace(",", "")
        folder.mkdir()
        job = LocalPSJob(folder, 2, base, spec)
        try:
            # The straggler: each of its steps takes 3x its own work (pull, compute,
            # push and the common --slow), so it is 3x slower, not 0.06 s slower.
            job.start_all(workers, extra={"w3": ["--slow-factor", "3"]})
            codes = job.wait_all(timeout=600)
            if any(codes.values()):
                raise RuntimeError(f"{name}: exit codes {codes}\n{job.logs()}")
            rate, dropped = _throughput(job, workers)
            slower = _slowdown(job, workers)
            counts = ps_done((folder / "ps-0.log").read_text())
        finally:
            job.close()
        results[name] = rate
        print(f"{name:>22}: {rate:8.0f} samples/s trained, {dropped} pushes dropped, "
              f"straggler's steps {slower:.1f}x as long; "
              f"ps-0 staleness of applied pushes {dict(counts.get('staleness', {}))}, "
              f"of dropped {dict(counts.get('dropped_staleness', {}))}")
    print(f"async / sync throughput = {results['async tau=8'] / results['sync']:.2f}x "
          f"(goal >= 2x); sync with a backup worker / sync = "
          f"{results['sync, 1 backup worker'] / results['sync']:.2f}x")
    return results


def bench_failover(root: Path, samples: int = 8192) -> dict[str, Any]:
    args = ["--samples", str(samples), "--vocab", "2000", "--dim", "8", "--batch-size", "32",
            "--epochs", "2", "--slow", "0.02"]
    job = LocalPSJob(root, 2, args, consistency("Async", tau=16))
    try:
        job.start_all(["w0", "w1"])
        job.wait_steps("w0", 30)
        before = [s["t"] for s in job.steps("w0")]
        killed = time.time()
        job.kill("ps-0")
        codes = job.wait_all()
        if any(codes[pod] != 0 for pod in ("w0", "w1", "ps-1")):
            raise RuntimeError(f"the job did not finish after the failover: {codes}\n"
                               + job.logs())
        steps = [s for w in ("w0", "w1") for s in job.steps(w)]
        # The first update that went through a promoted replica.
        after = [s["t"] for s in steps if s["t"] > killed and s.get("failovers", 0) > 0]
        lost = [line for w in ("w0", "w1") for line in
                (root / f"{w}.log").read_text().splitlines() if "ps_failover " in line]
    finally:
        job.close()
    # Samples the workers trained per epoch, against the epoch's size: more is a sample
    # trained twice, fewer one lost.
    trained = [sum(s["samples"] for s in steps if s["epoch"] == e) for e in range(2)]
    first = min(after) - killed
    interval = statistics.median(b - a for a, b in itertools.pairwise(before))
    # Each worker counts the versions it saw beyond the promoted copy; the updates the job
    # lost are what the worker that saw the newest version counts (they overlap).
    counts = [int(m.group(1)) for line in lost if (m := re.search(r"lost_updates=(\d+)", line))]
    print(f"failover: first update {first:.3f} s after SIGKILL of ps-0 (goal <= 2 s); "
          f"normal step interval {interval * 1e3:.1f} ms ({first / interval:.0f}x); "
          f"updates lost: {max(counts, default=0)} (per worker: "
          f"{'; '.join(line.split('ps_failover ', 1)[1] for line in lost)}); samples "
          f"trained per epoch {trained} of {samples} (repeated: "
          f"{sum(max(0, n - samples) for n in trained)}, lost: "
          f"{sum(max(0, samples - n) for n in trained)})")
    return {"failover_s": first, "interval_s": interval, "lost": max(counts, default=0),
            "trained": trained}


def slower_between(steps: list[dict[str, Any]], start: float, end: float,
                   interval: float) -> float:
    """How much longer than ``interval`` each a worker's steps that began after
    ``start`` and ended before ``end`` (wall-clock times) took, in all."""
    times = [float(s["t"]) for s in steps]
    return sum(max(0.0, b - a - interval) for a, b in itertools.pairwise(times)
               if start <= a and b <= end)


AFTER_S = 1.5
"""How long after a hand-over (at most: not past the next resize) the resize part adds up
the workers' slower steps."""


def bench_resize(root: Path, samples: int = 8192, vocab: int = 300_000,
                 dim: int = 32) -> dict[str, Any]:
    """Servers 2 -> 3 -> 2 while two workers train (three shards): the shard that moves
    holds a third of the example's tables (``vocab`` ids per field, ``dim`` wide) with
    their Adagrad state, 168 MB at the defaults."""
    args = ["--samples", str(samples), "--vocab", str(vocab), "--dim", str(dim),
            "--batch-size", "32", "--epochs", "2", "--slow", "0.02", "--optimizer", "adagrad"]
    job = LocalPSJob(root, 2, args, {**consistency("Async", tau=16), PSEnv.SHARDS: "3"})
    try:
        job.start_server(2)  # up before it is listed, as a pod the operator lists later
        job.start_all(["w0", "w1"])
        job.wait_steps("w0", 30)
        resized = {"grow": time.time()}
        job.resize(3)
        grown = moved(job.wait_log("ps-0", "ps_moved shard=2 to=2", 120))
        job.wait_steps("w0", len(job.steps("w0")) + 60)
        resized["shrink"] = time.time()
        job.resize(2)
        shrunk = moved(job.wait_log("ps-2", "ps_moved shard=2 to=0", 120))
        codes = job.wait_all()
        if any(code != 0 for code in codes.values()):
            raise RuntimeError(f"the job did not finish after the resizes: {codes}\n"
                               + job.logs())
        steps = {w: job.steps(w) for w in ("w0", "w1")}
    finally:
        job.close()
    trained = [sum(s["samples"] for w in steps for s in steps[w] if s["epoch"] == e)
               for e in range(2)]
    interval = statistics.median(b["t"] - a["t"] for a, b in itertools.pairwise(steps["w0"]))
    results: dict[str, Any] = {"interval_s": interval, "trained": trained}
    for name, move in (("grow", grown), ("shrink", shrunk)):
        overrun = max(step_overrun(steps[w], move["at"]) for w in steps)
        # Before the hand-over the servers copy whole shards to their new hosts: the
        # workers train on meanwhile, slower.
        before = max(slower_between(steps[w], resized[name], move["at"], interval)
                     for w in steps)
        # After it, the servers copy whole shards to the hosts of their new replicas, and
        # a server taken away ends: the workers train on meanwhile, slower.
        until = min(move["at"] + AFTER_S, resized.get("shrink", math.inf) if name == "grow"
                    else math.inf)
        after = max(slower_between(steps[w], move["at"], until, interval) for w in steps)
        results[name] = {"held_s": move["held_s"], "overrun_s": overrun, "bytes": move["bytes"],
                         "before_s": before, "window_s": move["at"] - resized[name],
                         "after_s": after}
        print(f"resize {name}: shard {int(move['shard'])} to ps-{int(move['to'])} "
              f"({move['bytes'] / MB:.2f} MB sent in the hand-over): no primary for "
              f"{move['held_s'] * 1e3:.1f} ms; the "
              f"workers' step around it {overrun * 1e3:.1f} ms over the median step "
              f"({interval * 1e3:.1f} ms); their steps from the resize to the hand-over "
              f"({move['at'] - resized[name]:.2f} s) {before * 1e3:.0f} ms longer in all "
              f"than at the median, in the {until - move['at']:.2f} s after it "
              f"{after * 1e3:.0f} ms")
    print(f"resize: samples trained per epoch {trained} of {samples}")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only",
                        default="throughput,dense,sparse,failover,resize,accuracy,skew")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--accuracy-seconds", type=float, default=60.0,
                        help="wall-clock seconds each mode trains in the accuracy part")
    parser.add_argument("--plot", type=Path, default=ROOT / "build" / "ps-accuracy.png",
                        help="where the accuracy part draws held-out loss over time")
    args = parser.parse_args()
    only = set(args.only.split(","))
    retain_freed_memory()  # as a worker pod does
    # One torch thread in the worker, as the test harness runs workers
    # (OMP_NUM_THREADS=1): on a small shared machine OpenMP's spinning threads take the
    # CPU the transport needs (a sparse pull measured 17 ms with two threads, 2.4 ms
    # with one, at a load average of 11 on 2 cores). The server takes its CPUs, as a
    # PS pod does.
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if "dense" in only:
            results["dense"] = bench_dense(args.repeats)
        if "sparse" in only:
            results["sparse"] = bench_sparse(max(args.repeats, 30))
        if "failover" in only:
            (Path(tmp) / "failover").mkdir()
            results["failover"] = bench_failover(Path(tmp) / "failover")
        if "resize" in only:
            (Path(tmp) / "resize").mkdir()
            results["resize"] = bench_resize(Path(tmp) / "resize")
        if "throughput" in only:
            results["throughput"] = bench_throughput(Path(tmp))
        if "skew" in only:
            results["skew"] = bench_skew()
        if "accuracy" in only:
            (Path(tmp) / "accuracy").mkdir()
            args.plot.parent.mkdir(parents=True, exist_ok=True)
            results["accuracy"] = bench_accuracy(Path(tmp) / "accuracy",
                                                 args.accuracy_seconds, args.plot.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
