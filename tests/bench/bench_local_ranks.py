"""Recovery from a pod kill with several ranks per pod: 2 pods x 3 ranks against 6 x 1.

The same six ranks, the same workload as the recovery benchmark (``recovery_common``),
under the same stand-in operator that learns of a death only from the survivors. One
pod is SIGKILLed (all of its ranks, as when a container dies): the time from the kill to
the first step without it; then a replacement pod is launched: the time from its launch
to the first step back at six ranks. 6 x 1 is the
baseline (one rank per pod, as before pods held several); the ratio is 2 x 3 over it.
A layout that does not recover fails the benchmark.

    python tests/bench/bench_local_ranks.py [--repeat N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.bench.recovery_ringwright import pod_kill  # noqa: E402

LAYOUTS = {"6 pods x 1 rank": (6, 1), "2 pods x 3 ranks": (2, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="runs per layout (median)")
    args = parser.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="ringwright-bench-ranks-"))
    print(f"workdir {base}", flush=True)
    results: dict[str, tuple[float, float]] = {}
    for name, (pods, procs) in LAYOUTS.items():
        runs = []
        for i in range(args.repeat):
            down, back = pod_kill(base / f"{pods}x{procs}-{i}", pods, procs)
            print(f"  {name} run {i + 1}: without the pod {down:.2f} s, "
                  f"replacement -> 6 {back:.2f} s", flush=True)
            runs.append((down, back))
        results[name] = (statistics.median(r[0] for r in runs),
                         statistics.median(r[1] for r in runs))
    baseline = results["6 pods x 1 rank"]
    print(f"\n{'layout':20}{'kill -> step without it':>26}{'replacement -> step at 6':>26}")
    for name, (down, back) in results.items():
        print(f"{name:20}{down:>20.2f} s ({down / baseline[0]:.2f}x)"
              f"{back:>17.2f} s ({back / baseline[1]:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
