"""Benchmark: the elastic sampler's memory and cost per batch, up to a billion samples,
against the shuffled list it replaced.

For each dataset size it measures, in one run on one machine:

* memory: the resident-set growth of making the sampler and drawing batches from the
  middle of an epoch (the order is computed per position: no list);
* µs per batch: ``sampler.batch()`` (one rank's share of a global batch) and one
  ``next()`` of ``iter(sampler)``, what a ``DataLoader`` calls, for each batch size;
* first batch of an epoch (or after a rollback into a new epoch): no shuffle to wait for.

The baseline, measured at ``--baseline-samples`` in the same run, is the previous
design: ``list(range(n))`` shuffled once per epoch. Its memory and shuffle time grow
linearly with ``n``; the ratios extrapolate them to each size.

Run: ``python tests/bench/bench_sampler.py`` (``--sizes 1000000,1000000000
--batches 32,256 --world 8 --baseline-samples 2000000``).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from collections.abc import Callable

from ringwright.runtime.sampler import ElasticSampler

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Resident set of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    """Mean microseconds per call over ``calls`` calls (after one warm-up call)."""
    fn()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls * 1e6


def measure(samples: int, batch: int, world: int, calls: int) -> dict[str, float]:
    gc.collect()
    before = rss_bytes()
    sampler = ElasticSampler(samples, batch, seed=1)
    sampler.set_world(3 % world, world)
    sampler.offset = samples // 4  # inside an epoch, as after a resume
    made = time.perf_counter()
    first = sampler.batch()
    first_us = (time.perf_counter() - made) * 1e6
    batch_us = per_call_us(sampler.batch, calls)
    iterator = iter(sampler)
    next_us = per_call_us(lambda: next(iterator), min(calls, len(sampler) - 1))
    grown = rss_bytes() - before
    assert len(first) == batch
    return {"rss_mb": grown / 2**20, "first_us": first_us, "batch_us": batch_us,
            "next_us": next_us}


def baseline(samples: int) -> dict[str, float]:
    """The list design: memory of the shuffled order and the time to shuffle it."""
    gc.collect()
    before = rss_bytes()
    started = time.perf_counter()
    order = list(range(samples))
    random.Random("ringwright-sampler:1:0").shuffle(order)
    shuffle_s = time.perf_counter() - started
    grown = rss_bytes() - before
    del order
    return {"rss_mb": grown / 2**20, "shuffle_s": shuffle_s}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000000,1000000000")
    parser.add_argument("--batches", default="32,256")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--baseline-samples", type=int, default=2_000_000)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]

    print(f"elastic sampler, world of {args.world}, {args.calls} calls per figure")
    print(f"{'samples':>14} {'batch':>6} {'RSS delta MB':>13} {'first batch µs':>15} "
          f"{'batch() µs':>11} {'next(iter) µs':>14}")
    results = {}
    for samples in sizes:
        for batch in batches:
            r = measure(samples, batch, args.world, args.calls)
            results[(samples, batch)] = r
            print(f"{samples:>14,} {batch:>6} {r['rss_mb']:>13.2f} {r['first_us']:>15.1f} "
                  f"{r['batch_us']:>11.1f} {r['next_us']:>14.1f}")

    base = baseline(args.baseline_samples)
    per_sample_mb = base["rss_mb"] / args.baseline_samples
    per_sample_s = base["shuffle_s"] / args.baseline_samples
    print(f"\nbaseline (shuffled list) at {args.baseline_samples:,} samples: "
          f"{base['rss_mb']:.0f} MB, {base['shuffle_s']:.2f} s to shuffle")
    for samples in sizes:
        worst = max(results[(samples, b)]["rss_mb"] for b in batches)
        first = max(results[(samples, b)]["first_us"] for b in batches)
        list_mb, list_s = per_sample_mb * samples, per_sample_s * samples
        print(f"{samples:>14,} samples: list ~{list_mb:,.0f} MB and ~{list_s:,.1f} s per "
              f"epoch (extrapolated) vs sampler {worst:.2f} MB; first batch "
              f"{list_s * 1e6 / first:,.0f}x sooner")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
