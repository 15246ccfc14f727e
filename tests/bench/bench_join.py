"""What a join costs the members already training: their idle seconds per join.

Four workers of the test worker (``tests/runtime/elastic_worker.py``) train on loopback
under the local launcher, with ``--state-mb`` of state per worker (a buffer every state
broadcast carries), so the join's state transfer counts. Rank 2's process is killed and
a newcomer takes its place, starting slowly (``--start-delay`` seconds before it sets up
its training: on a real node the image pull, the imports, CUDA start-up):

* ``replace``: the killed pod is gone; a new pod is started, as the operator creates a
  replacement (the launcher's scale back to four);
* ``restart``: the killed process is started again in its pod, as the kubelet restarts
  a crashed container (the launcher's ``restart``).

For each survivor, from its ``stepped`` trace records: the gaps between consecutive
completed steps, each less the survivor's median gap before the fault (a step's own
time). Reported per survivor, median and worst over the survivors:

* ``join idle``: the gap that ends at its first step in the world of four, the time it
  stood still for the join (state transfer, group formation, and whatever it waited for
  the newcomer);
* ``fault to full``: the sum over every gap from the fault to that step (the failure's
  own recovery included);
* ``launch to full``: from the kill to the first step at four, for scale.

    python tests/bench/bench_join.py [--scenarios replace,restart] [--state-mb 100]
                                     [--start-delay 3] [--repeats 1]
"""

from __future__ import annotations

import argparse
import itertools
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ringwright.runtime.local.launcher import LocalJob  # noqa: E402
from tests.bench.recovery_common import (  # noqa: E402
    KILL_AT_STEP,
    VICTIM,
    WAIT_S,
    WORKLOAD,
    BaselineFailed,
    steps_done,
    time_to_size,
    wait_until,
)
from tests.runtime.elastic_traces import Record, Traces  # noqa: E402

WORKER = ROOT / "tests" / "runtime" / "elastic_worker.py"
WORKERS = 4
STEPS_AT_FULL = 5
"""Steps trained by the world of four before the scenario ends (its first gaps settle)."""


@dataclass(frozen=True)
class Idle:
    """One survivor's idle seconds in one run."""

    join: float
    fault_to_full: float


def survivor_idle(steps: list[Record], fault: float, full_generation: int) -> Idle:
    """Idle seconds of one survivor from its ``stepped`` records (in the order written)."""
    times = [r["t"] for r in steps]
    before = [b - a for a, b in itertools.pairwise(times) if b < fault]
    if len(before) < 3:
        raise BaselineFailed("too few steps before the fault to know a step's time")
    step = statistics.median(before)
    first_full = next(i for i, r in enumerate(steps)
                      if r["generation"] == full_generation and r["t"] > fault)
    gaps = [max(times[i] - times[i - 1] - step, 0.0) for i in range(1, first_full + 1)
            if times[i] > fault]
    return Idle(join=gaps[-1], fault_to_full=sum(gaps))


def run_once(workdir: Path, scenario: str, state_mb: int, start_delay: float
             ) -> tuple[list[Idle], float]:
    """One kill and join; the survivors' idle seconds and the kill-to-full seconds."""
    env = {**WORKLOAD, "TRACE_DIR": str(workdir / "trace"), "BALLAST_MB": str(state_mb)}
    trace_dir = workdir / "trace"
    with LocalJob([sys.executable, str(WORKER)], workdir, env=env,
                  restart=scenario == "restart") as job:
        job.start(WORKERS)
        wait_until("training", lambda: steps_done(trace_dir) >= KILL_AT_STEP)
        # Only the newcomer starts slowly: the delay is read when a process starts.
        job.env["START_DELAY_S"] = str(start_delay)
        victim = job.world.members[VICTIM].pod
        survivors = [m.pod for m in job.world.members if m.pod != victim]
        fault = time.time()
        job.kill(victim, signal.SIGKILL)
        if scenario == "replace":
            if time_to_size(trace_dir, WORKERS - 1, fault, WAIT_S) is None:
                raise BaselineFailed(f"never trained at {WORKERS - 1}; logs in {workdir}")
            job.scale(WORKERS)
        full = time_to_size(trace_dir, WORKERS, fault, WAIT_S)
        if full is None:
            raise BaselineFailed(f"never trained at {WORKERS} again; logs in {workdir}")
        generation = job.world.generation
        target = steps_done(trace_dir) + STEPS_AT_FULL
        wait_until("steps at full size", lambda: steps_done(trace_dir) >= target)
    t = Traces.load(trace_dir)
    idle = [survivor_idle([r for r in t.by_pod[pod] if r["ev"] == "stepped"], fault,
                          generation) for pod in survivors]
    return idle, full


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="replace,restart")
    parser.add_argument("--state-mb", type=int, default=100)
    parser.add_argument("--start-delay", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    if unknown := [s for s in scenarios if s not in ("replace", "restart")]:
        parser.error(f"unknown scenarios: {unknown}")
    base = Path(tempfile.mkdtemp(prefix="ringwright-bench-join-"))
    print(f"workdir {base}; {WORKERS} workers, {args.state_mb} MB of state each, newcomer "
          f"start-up delay {args.start_delay:.1f} s", flush=True)
    head = (f"{'scenario':10}{'join idle s (median / worst)':>32}"
            f"{'fault to full s (median / worst)':>36}{'kill to full s':>16}")
    rows = []
    for scenario in scenarios:
        for n in range(args.repeats):
            idle, full = run_once(base / f"{scenario}-{n}", scenario, args.state_mb,
                                  args.start_delay)
            join = [i.join for i in idle]
            whole = [i.fault_to_full for i in idle]
            row = (f"{scenario:10}"
                   f"{f'{statistics.median(join):.2f} / {max(join):.2f}':>32}"
                   f"{f'{statistics.median(whole):.2f} / {max(whole):.2f}':>36}"
                   f"{full:>16.2f}")
            print(row, flush=True)
            rows.append(row)
    print(f"\n{head}\n{'-' * len(head)}\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
