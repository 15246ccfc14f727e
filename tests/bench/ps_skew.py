"""Benchmark part: how evenly Zipf-distributed embedding ids load the parameter servers.

Three real servers hold a table of 10,000,000 x 64 rows that they create on first use;
one client pulls the rows of Zipf(1.1) batches of 4,096 ids and pushes a gradient for
each, as a worker does. Measured per server: the rows it served and the CPU time its
process spent; the figure is the hottest server over the mean (goal <= 1.2). Beside it,
from the same ids: the load without the client's de-duplication (every use of an id
asks for its row) and with the table cut into contiguous id ranges instead of hashed
buckets — the two things that keep the hot ids from piling onto one server.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from ringwright.runtime.ps.partition import Kind, TensorSpec
from ringwright.runtime.ps.serving.consistency import Consistency, Mode
from ringwright.runtime.ps.serving.hosting import JobConfig
from ringwright.runtime.ps.serving.optim import OptimizerKind, ServerOptimizer
from ringwright.runtime.ps.wire.client import PSClient
from tests.procstat import cpu_seconds
from tests.ps.harness import free_port

ROOT = Path(__file__).resolve().parents[2]
SERVER = """
import os, sys, time, torch
torch.set_num_threads(1)
from ringwright.runtime.ps.memory import retain_freed_memory
from ringwright.runtime.ps.serving.server import ParameterServer
from ringwright.runtime.ps.wire.transport import serve
retain_freed_memory()
server = serve(ParameterServer(int(sys.argv[2])), sys.argv[1])
time.sleep(3600)
"""
GOAL = 1.2


class ZipfIds:
    """Ids ``0 .. rows-1`` drawn with probability proportional to ``(id + 1) ** -a``: id 0
    is the hottest, as in a vocabulary sorted by frequency."""

    def __init__(self, rows: int, a: float, seed: int) -> None:
        weights = np.arange(1, rows + 1, dtype=np.float64) ** -a
        self.cdf = np.cumsum(weights)
        self.cdf /= self.cdf[-1]
        self.rng = np.random.default_rng(seed)

    def draw(self, n: int) -> npt.NDArray[np.int64]:
        ids: npt.NDArray[np.int64] = np.searchsorted(self.cdf, self.rng.random(n))
        return ids


def spread(loads: npt.NDArray[np.int64] | npt.NDArray[np.float64]) -> float:
    """Hottest over mean."""
    return float(np.max(loads) / np.mean(loads))


def range_loads(ids: npt.NDArray[np.int64], rows: int, shards: int) -> npt.NDArray[np.int64]:
    """Per shard, how many of ``ids`` fall in its contiguous third (quarter, ...) of ids."""
    out: npt.NDArray[np.int64] = np.bincount(ids * shards // rows, minlength=shards)
    return out


@dataclass
class SkewResult:
    served: float
    """Rows served, hottest server over the mean."""
    cpu: float
    """CPU seconds, hottest server over the mean."""
    no_dedup: float
    ranges: float
    unique_per_step: float


def bench_skew(steps: int = 300, rows: int = 10_000_000, dim: int = 64, servers: int = 3,
               batch: int = 4096) -> SkewResult:
    """Runs the servers, drives them, prints and returns the figures."""
    ports = [free_port() for _ in range(servers)]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    procs = [subprocess.Popen([sys.executable, "-c", SERVER, a, str(i)], cwd=ROOT)
             for i, a in enumerate(addresses)]
    try:
        client = PSClient(addresses, "bench", call_timeout=600)
        client.wait_ready(120)
        spec = TensorSpec("t", (rows, dim), kind=Kind.EMBEDDING, init_std=0.01)
        config = JobConfig((spec,), servers, ServerOptimizer(OptimizerKind.ADAGRAD, lr=0.01),
                           Consistency(Mode.ASYNC, 10**9),
                           {"samples": 1, "pieceSize": 1, "epochs": 1})
        client.initialize(config, {})
        partition = client.partition
        assert partition is not None
        zipf = ZipfIds(rows, 1.1, seed=0)
        served = np.zeros(servers, dtype=np.int64)
        every_use = np.zeros(servers, dtype=np.int64)
        ranges = np.zeros(servers, dtype=np.int64)
        unique = []
        warm = 20  # rows are created on first use: the first steps create the hot ones
        for step in range(warm + steps):
            if step == warm:
                cpu_before = [cpu_seconds(p.pid) for p in procs]
            ids = zipf.draw(batch)
            pulled = client.pull({"t": torch.from_numpy(ids)}, dense=False)
            got, values = pulled.rows["t"]
            client.push({}, {"t": (got, torch.ones_like(values))}, pulled.versions)
            if step >= warm:
                served += partition.rows_asked("t", ids)
                every_use += np.bincount(partition.row_shards("t", ids), minlength=servers)
                ranges += range_loads(np.unique(ids), rows, servers)
                unique.append(len(got))
        cpu = np.array([cpu_seconds(p.pid) - b for p, b in zip(procs, cpu_before, strict=True)])
        client.close()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for p in procs:
        if p.returncode not in (-9, 0):
            raise RuntimeError(f"a server exited with {p.returncode}")
    result = SkewResult(spread(served), spread(cpu), spread(every_use), spread(ranges),
                        statistics.mean(unique))
    print(f"skew: Zipf(1.1) ids over {rows:,} x {dim} rows on {servers} servers, {steps} "
          f"steps of {batch:,} ids ({result.unique_per_step:,.0f} unique a step), "
          "hottest server over the mean:")
    print(f"  rows served (hashed buckets, each row once a pull): {result.served:.2f} "
          f"(goal <= {GOAL}); server CPU seconds: {result.cpu:.2f} "
          f"({', '.join(f'{c:.1f}' for c in cpu)} s)")
    print(f"  same ids, hashed buckets asked once per use: {result.no_dedup:.2f}; contiguous "
          f"id ranges: {result.ranges:.2f}")
    return result
