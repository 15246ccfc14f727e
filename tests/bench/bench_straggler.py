"""A worker slow for good is replaced; a one-off pause costs nothing (local launcher).

Four workers train the recovery benchmark's workload (``recovery_common.WORKLOAD``) with a
longer simulated compute per step (``STEP_SLEEP``), under the local launcher applying the
operator's straggler rule (:mod:`ringwright.stragglers`) to the stats the members send
every second:

* slowed: one worker's compute is doubled for good (``SLOW_POD``, ``SLOW_FACTOR=2``); the
  ring runs at its pace until the rule (factor 1.5, a 10 s window) replaces it with a new
  process (one spare). Throughput (samples per second, from the workers' traces) before
  the replacement and after the new world of four trains; goal: at least 1.6x.
* paused: one worker sleeps 30 s once (``PAUSE_*``); goal: no new world at all.

    python tests/bench/bench_straggler.py

Exits 1 when the slow worker is not replaced, or the pause causes a new world.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ringwright.runtime.local.launcher import LocalJob  # noqa: E402
from ringwright.runtime.settings import SettingsEnv  # noqa: E402
from ringwright.stragglers import StragglerRule  # noqa: E402
from tests.bench.recovery_common import WORKLOAD, steps_done, wait_until  # noqa: E402
from tests.runtime.elastic_traces import Traces  # noqa: E402

WORKER = ROOT / "tests" / "runtime" / "elastic_worker.py"
WORKERS = 4
SLOW = "bench-worker-3"
RULE = StragglerRule(factor=1.5, window_s=10.0, spares=1)
PAUSE_S = 30.0
MEASURE_S = 12.0
"""Seconds of training at full speed measured after the replacement."""
GOAL = 1.6
ENV = {**WORKLOAD, "STEP_SLEEP": "0.1", SettingsEnv.STATS_INTERVAL: "1"}


def samples_per_second(trace_dir: Path, start: float, end: float) -> float:
    """Samples the whole world trained per second between ``start`` and ``end``."""
    samples = sum(len(r["indices"]) for _, r in Traces.load(trace_dir).events("step")
                  if start <= r["t"] < end)
    return samples / (end - start)


def job(workdir: Path, extra: dict[str, str]) -> LocalJob:
    env = {**ENV, "TRACE_DIR": str(workdir / "trace"), **extra}
    return LocalJob([sys.executable, str(WORKER)], workdir, job="bench", env=env,
                    stragglers=RULE)


def slowed(workdir: Path) -> tuple[float, float, float]:
    """(samples/s before, after, seconds from the first step to the replacement)."""
    trace = workdir / "trace"
    with job(workdir, {"SLOW_POD": SLOW, "SLOW_FACTOR": "2"}) as local:
        local.start(WORKERS)
        wait_until("training", lambda: steps_done(trace) >= 10)
        began = time.time()
        wait_until("the straggler leaving the world",
                   lambda: SLOW not in local.world.pods, timeout=180)
        flagged = time.time()
        before = samples_per_second(trace, began, flagged)
        wait_until("the replacement in the world",
                   lambda: len(local.world.pods) == WORKERS and SLOW not in local.world.pods,
                   timeout=180)
        joined = time.time()
        wait_until("a step of the new world", lambda: any(
            r["t"] > joined and r["size"] == WORKERS
            for _, r in Traces.load(trace).events("stepped")), timeout=120)
        start = time.time()
        time.sleep(MEASURE_S)
        after = samples_per_second(trace, start, time.time())
    return before, after, flagged - began


def paused(workdir: Path) -> tuple[int, bool]:
    """(world generations published after the first, whether the pause happened)."""
    trace = workdir / "trace"
    extra = {"PAUSE_RANK": "2", "PAUSE_STEP": "20", "PAUSE_SECONDS": str(PAUSE_S),
             "PAUSE_FILE": str(workdir / "paused")}
    with job(workdir, extra) as local:
        local.start(WORKERS)
        wait_until("the pause", lambda: (workdir / "paused").exists(), timeout=180)
        resumed_by = time.time() + PAUSE_S
        target = 20 + 30
        wait_until(f"step {target} after the pause", lambda: steps_done(trace) >= target,
                   timeout=PAUSE_S + 180)
        # Past the pause by more than the rule's window: time enough to act, were it to.
        time.sleep(max(resumed_by + RULE.window_s + 5 - time.time(), 0))
        return local.world.generation, bool(Traces.load(trace).events("pause"))


def main() -> int:
    failed = []
    with tempfile.TemporaryDirectory(prefix="bench-straggler-") as tmp:
        before, after, took = slowed(Path(tmp) / "slowed")
        ratio = after / before if before else 0.0
        generations, paused_once = paused(Path(tmp) / "paused")
    print("\n| scenario | figure | goal |")
    print("|---|---|---|")
    print(f"| one worker 2x slow for good, 1 spare | {before:.1f} -> {after:.1f} samples/s "
          f"(x{ratio:.2f}); replaced {took:.0f} s after training began "
          f"(window {RULE.window_s:.0f} s) | >= {GOAL}x: {'met' if ratio >= GOAL else 'NOT met'} |")
    print(f"| one worker paused {PAUSE_S:.0f} s once | {generations} new world generation(s) "
          f"| none: {'met' if generations == 0 else 'NOT met'} |")
    if not paused_once:
        failed.append("the pause never happened")
    if generations:
        failed.append("the one-off pause caused a new world")
    if failed:
        print("failed: " + "; ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
