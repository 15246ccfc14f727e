"""Run every benchmark, one after the other, each in its own process (``make bench``).

Each benchmark measures its own baseline in the same run and prints ratios; this only
sequences them and says which failed. Pass names to run a subset:

    python tests/bench/run_all.py [placement] [checkpoint] [recovery] [recovery_paths]
                                  [operator] [network] [ps] [sampler] [dataloader]
                                  [local_ranks] [straggler] [join] [goodput]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from ringwright.runtime.local import forkserver

HERE = Path(__file__).resolve().parent
BENCHES = {
    "placement": "bench_placement.py",
    "checkpoint": "bench_checkpoint.py",
    "recovery": "bench_recovery.py",
    "recovery_paths": "bench_recovery_paths.py",
    "operator": "bench_operator.py",
    "network": "bench_network.py",
    "ps": "bench_ps.py",
    "sampler": "bench_sampler.py",
    "dataloader": "bench_dataloader.py",
    "local_ranks": "bench_local_ranks.py",
    "straggler": "bench_straggler.py",
    "join": "bench_join.py",
    "goodput": "bench_goodput.py",
}


def main(argv: list[str]) -> int:
    unknown = [n for n in argv if n not in BENCHES]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {sorted(BENCHES)}", file=sys.stderr)
        return 2
    failed = []
    for name in argv or list(BENCHES):
        print(f"\n=== {name} ({BENCHES[name]})", flush=True)
        started = time.monotonic()
        # From / so the repository's operator/ folder never shadows the standard library.
        # Workers start from nothing, as a kubelet's containers do: a forked worker would
        # skip the import that every start and recovery time here includes.
        env = {k: v for k, v in os.environ.items() if k != forkserver.SETTING}
        rc = subprocess.call([sys.executable, str(HERE / BENCHES[name])], cwd="/", env=env)
        print(f"=== {name}: exit {rc} after {time.monotonic() - started:.0f}s", flush=True)
        if rc != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
