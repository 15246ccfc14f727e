"""Benchmark: DataLoader throughput with the elastic batch sampler against torch's
``DistributedSampler`` + ``BatchSampler``, at 0, 2 and 4 loader workers; then the
index generation at a billion samples (``bench_sampler``'s figures) and for leased
shards.

Both loaders read the same map-style dataset (the same work per sample: a small
matrix product) as rank 3 of a world of 8, batches of 32, persistent workers. One
figure is one epoch of that rank, from ``iter(loader)`` to its end; the elastic
sampler's cursor moves with ``advance()`` after every batch, as training moves it. The
two alternate, round after round, and each keeps its median. A row also runs the leased
shards' loader (``ElasticShards.loader``) over the same samples in 64 shards. Goal: the
elastic sampler at 0.95 or more of the baseline. A baseline that fails (an exception,
or an epoch with missing or repeated samples) fails the benchmark.

Run: ``python tests/bench/bench_dataloader.py`` (``--samples 100000 --rounds 5
--workers 0,2,4``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ringwright.runtime.data import ElasticShards  # noqa: E402
from ringwright.runtime.sampler import ElasticSampler  # noqa: E402
from tests.bench import bench_sampler  # noqa: E402  (its index-generation figures)

RANK, WORLD, BATCH = 3, 8, 32
SHARDS = 64


class Work(Dataset[tuple[int, torch.Tensor]]):
    """Sample ``i``: its index and a small matrix product (the per-sample work)."""

    def __init__(self, samples: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.samples = samples
        self.table = torch.randn(256, 64, generator=gen)
        self.weight = torch.randn(64, 64, generator=gen)

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, torch.tanh(self.table[i % 256] @ self.weight)


class Baseline:
    """``DistributedSampler`` + ``BatchSampler``: what a DDP script uses."""

    name = "DistributedSampler"

    def __init__(self, data: Work, workers: int) -> None:
        self.sampler: DistributedSampler[int] = DistributedSampler(
            data, num_replicas=WORLD, rank=RANK, seed=1)
        self.loader = DataLoader(data, batch_sampler=BatchSampler(self.sampler, BATCH, False),
                                 num_workers=workers, persistent_workers=workers > 0)
        self.epoch = 0
        self.per_epoch = -(-len(data) // WORLD)

    def expected(self) -> int:
        return self.per_epoch

    def epoch_ids(self) -> Iterable[Any]:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return self.loader

    def after_batch(self) -> None:
        pass


class Elastic:
    """The elastic batch sampler, advanced after every batch."""

    name = "ElasticSampler"

    def __init__(self, data: Work, workers: int) -> None:
        self.sampler = ElasticSampler(len(data), BATCH, seed=1)
        self.sampler.set_world(RANK, WORLD)
        self.loader = DataLoader(data, batch_sampler=self.sampler, num_workers=workers,
                                 persistent_workers=workers > 0)

    def expected(self) -> int:
        return sum(len(b) for b in self.sampler)

    def epoch_ids(self) -> Iterable[Any]:
        return self.loader

    def after_batch(self) -> None:
        self.sampler.advance()


class Shards:
    """Leased shards through their own loader, over the same samples."""

    name = "ElasticShards loader"

    def __init__(self, data: Work, workers: int) -> None:
        size, extra = divmod(len(data), SHARDS)
        self.shards = ElasticShards([size + (s < extra) for s in range(SHARDS)], BATCH, seed=1)
        self.shards.set_world(RANK, WORLD)
        starts = self.shards.starts

        def read(shard: int, start: int, stop: int) -> list[tuple[int, torch.Tensor]]:
            return [data[i] for i in range(starts[shard] + start, starts[shard] + stop)]

        self.loader = self.shards.loader(read, num_workers=workers,
                                         persistent_workers=workers > 0)

    def expected(self) -> int:
        return sum(len(b) for b in self.shards)

    def epoch_ids(self) -> Iterable[Any]:
        return self.loader

    def after_batch(self) -> None:
        self.shards.advance()


def one_epoch(run: Baseline | Elastic | Shards) -> float:
    """Samples per second over one epoch of this rank; checks what was delivered."""
    seen: list[int] = []
    expected = run.expected()
    started = time.perf_counter()
    for batch in run.epoch_ids():
        if len(batch) == 0:  # a rank left without samples at the very end
            run.after_batch()
            continue
        ids, _ = batch
        seen.extend(ids.tolist())
        run.after_batch()
    elapsed = time.perf_counter() - started
    if len(seen) != expected or len(set(seen)) != len(seen):
        raise AssertionError(f"{run.name}: {len(seen)} samples, {len(set(seen))} distinct, "
                             f"expected {expected} distinct")
    return len(seen) / elapsed


def compare(data: Work, workers: int, rounds: int) -> dict[str, float]:
    """Median samples/s of each loader, alternating, after one warm-up epoch each."""
    runs: list[Baseline | Elastic | Shards] = [Baseline(data, workers), Elastic(data, workers),
                                              Shards(data, workers)]
    rates: dict[str, list[float]] = {r.name: [] for r in runs}
    for r in runs:
        one_epoch(r)  # starts the persistent workers
    for _ in range(rounds):
        for r in runs:
            rates[r.name].append(one_epoch(r))
    return {name: statistics.median(values) for name, values in rates.items()}


def shard_indices(samples: int, shards: int, calls: int) -> dict[str, float]:
    """Memory and µs per step of leased shards' ids at ``samples`` in ``shards`` shards."""
    before = bench_sampler.rss_bytes()
    s = ElasticShards([samples // shards] * shards, BATCH, seed=1)
    s.set_world(RANK, WORLD)
    for _ in range(1000):
        s.advance()  # well inside the epoch
    batch_us = bench_sampler.per_call_us(s.batch, calls)
    iterator = iter(s)
    next_us = bench_sampler.per_call_us(lambda: next(iterator), calls)
    advance_us = bench_sampler.per_call_us(s.advance, calls)
    return {"rss_mb": (bench_sampler.rss_bytes() - before) / 2**20, "batch_us": batch_us,
            "next_us": next_us, "advance_us": advance_us}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", default="0,2,4")
    parser.add_argument("--index-samples", type=int, default=1_000_000_000)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = Work(args.samples)

    print(f"DataLoader throughput, rank {RANK} of {WORLD}, batch {BATCH}, "
          f"{args.samples:,} samples, median of {args.rounds} epochs (samples/s)")
    print(f"{'workers':>7} {'Distributed':>12} {'Elastic':>10} {'ratio':>6} "
          f"{'Shards':>10} {'ratio':>6}")
    worst = float("inf")
    for workers in (int(w) for w in args.workers.split(",")):
        r = compare(data, workers, args.rounds)
        base = r[Baseline.name]
        ratio, shard_ratio = r[Elastic.name] / base, r[Shards.name] / base
        worst = min(worst, ratio)
        print(f"{workers:>7} {base:>12,.0f} {r[Elastic.name]:>10,.0f} {ratio:>6.2f} "
              f"{r[Shards.name]:>10,.0f} {shard_ratio:>6.2f}", flush=True)
    print(f"elastic / distributed, worst: {worst:.2f} (goal >= 0.95)")

    print(f"\nindex generation at {args.index_samples:,} samples, world of {WORLD}")
    print(f"{'':>22} {'batch':>6} {'RSS delta MB':>13} {'batch() µs':>11} "
          f"{'next(iter) µs':>14} {'advance() µs':>13}")
    for batch in (32, 256):
        m = bench_sampler.measure(args.index_samples, batch, WORLD, 300)
        print(f"{'ElasticSampler':>22} {batch:>6} {m['rss_mb']:>13.2f} {m['batch_us']:>11.1f} "
              f"{m['next_us']:>14.1f} {'':>13}")
    s = shard_indices(args.index_samples, 100_000, 300)
    print(f"{'ElasticShards (1e5 sh)':>22} {BATCH:>6} {s['rss_mb']:>13.2f} "
          f"{s['batch_us']:>11.1f} {s['next_us']:>14.1f} {s['advance_us']:>13.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
