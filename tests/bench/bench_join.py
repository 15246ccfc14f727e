"""What a join costs the members already training: their idle seconds per join.

Four workers of the test worker (``tests/runtime/elastic_worker.py``) train on loopback
with ``--state-mb`` of state per worker (a buffer every state broadcast carries), so the
join's state transfer counts. Rank 2's process is killed and a newcomer takes its place,
starting slowly (``--start-delay`` seconds before it sets up its training: on a real node
the image pull, the imports, CUDA start-up):

* ``replace``: the killed pod is gone; a new pod is started (the launcher's scale back to
  four; on the cluster the pod is deleted and the operator creates its replacement);
* ``restart``: the killed process is started again in its pod, as the kubelet restarts
  a crashed container (the launcher's ``restart``; on the cluster the pod host's).

Two paths (``--paths``): ``local``, the local launcher; ``podhost``, the local cluster
(control plane, KWOK nodes, the pod host running the worker as each pod's process) with
the operator deciding when the newcomer enters the world, as it does for users.

For each survivor, from its ``stepped`` and ``commit`` trace records: the gaps between
consecutive completed steps, each less what such a gap took before the fault (the
median gap with a commit in it, or without one: a commit copies the whole state).
Reported as the median and the worst over the survivors:

* ``join idle``: the gap that ends at its first step in the world of four, the time it
  stood still for the join (group formation, state transfer, and whatever it waited
  for the newcomer); when it left its world at a commit for the join, counted from
  leaving (after the commit's own copy of the state), less a step's usual time;
* ``failure idle``: the gap in which the fault fell (detection and re-forming without
  the dead member); the same gap as the join's when the survivors never trained
  without it;
* ``kill to full``: from the kill to the first step at four, for scale.

    python tests/bench/bench_join.py [--paths local,podhost] [--scenarios replace,restart]
                                     [--state-mb 100] [--start-delay 3] [--repeats 1]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ringwright.devcluster.demo import current_world  # noqa: E402
from ringwright.devcluster.podhost import PodHost  # noqa: E402
from ringwright.kube import KubeClient, api_path  # noqa: E402
from ringwright.runtime.local.launcher import LocalJob  # noqa: E402
from ringwright.world import World  # noqa: E402
from tests.bench.bench_recovery_paths import (  # noqa: E402
    JOB,
    START_S,
    job_in,
    job_manifest,
    operated_cluster,
)
from tests.bench.recovery_common import (  # noqa: E402
    VICTIM,
    WAIT_S,
    WORKLOAD,
    BaselineFailed,
    steps_done,
    time_to_size,
    wait_until,
)
from tests.e2e.test_elastic_job import HostThread  # noqa: E402
from tests.runtime.elastic_traces import Record, Traces  # noqa: E402

WORKER = ROOT / "tests" / "runtime" / "elastic_worker.py"
PATHS = {"local": "local launcher", "podhost": "KWOK + pod host"}
WORKERS = 4
FAULT_AFTER_STEP = 45
"""The kill comes once this step is done: after four commits, to know what one costs."""
STEPS_AT_FULL = 5
"""Steps trained by the world of four before the scenario ends (its first gaps settle)."""


@dataclass(frozen=True)
class Idle:
    """One survivor's idle seconds in one run."""

    join: float
    failure: float


def survivor_idle(records: list[Record], fault: float, full_generation: int) -> Idle:
    """Idle seconds of one survivor from its trace records (in the order written)."""
    steps = [r for r in records if r["ev"] == "stepped"]
    committed = {r["step"] for r in records if r["ev"] == "commit"}

    def usual(with_commit: bool) -> float:
        gaps: list[float] = [b["t"] - a["t"] for a, b in itertools.pairwise(steps)
                if b["t"] < fault and (a["step"] in committed) == with_commit]
        if len(gaps) < 3:
            raise BaselineFailed("too few steps before the fault to know a step's time")
        return float(statistics.median(gaps))

    normal, at_commit = usual(False), usual(True)

    def idle(i: int) -> float:
        a, b = steps[i - 1], steps[i]
        gap: float = b["t"] - a["t"]
        return max(gap - (at_commit if a["step"] in committed else normal), 0.0)

    first_full = next(i for i, r in enumerate(steps)
                      if r["generation"] == full_generation and r["t"] > fault)
    failed = next(i for i, r in enumerate(steps) if r["t"] > fault)
    # Left at a commit for the join: timed from leaving, after the commit's own copy.
    left = [r for r in records if r["ev"] == "interrupted" and r["why"] == "WorldChanged"
            and steps[first_full - 1]["t"] <= r["t"] <= steps[first_full]["t"]]
    join = steps[first_full]["t"] - left[-1]["t"] - normal if left else idle(first_full)
    return Idle(join=max(join, 0.0), failure=idle(failed))


def back_to_full(trace_dir: Path, before: int, fault: float) -> float:
    """Seconds from the fault to the first step of a later world of every worker (a step
    of world ``before`` may still complete after the fault)."""
    def first() -> float | None:
        return min((r["t"] for _, r in Traces.load(trace_dir).events("stepped")
                    if r["size"] == WORKERS and r["generation"] > before), default=None)

    wait_until(f"a step at size {WORKERS} again", lambda: first() is not None)
    done = first()
    assert done is not None
    return done - fault


@dataclass(frozen=True)
class Driver:
    """How one path is driven: its current world, a kill, and what follows a kill."""

    trace_dir: Path
    world: Callable[[], World]
    kill: Callable[[str], None]
    slow_newcomers: Callable[[], None]
    """From now on, processes that start take ``--start-delay`` first."""
    replace: Callable[[], None] | None
    """After the world without the victim trains: start its replacement (None: the
    path's own controller replaces it)."""


def measure(path: Driver) -> tuple[list[Idle], float]:
    """One kill and join; the survivors' idle seconds and the kill-to-full seconds."""
    trace_dir = path.trace_dir
    wait_until("training", lambda: steps_done(trace_dir) >= FAULT_AFTER_STEP, START_S)
    path.slow_newcomers()
    world = path.world()
    before = world.generation
    victim = world.members[VICTIM].pod
    survivors = [m.pod for m in world.members if m.pod != victim]
    fault = time.time()
    path.kill(victim)
    if path.replace is not None:
        if time_to_size(trace_dir, WORKERS - 1, fault, WAIT_S) is None:
            raise BaselineFailed(f"never trained at {WORKERS - 1}; traces in {trace_dir}")
        path.replace()
    full = back_to_full(trace_dir, before, fault)
    generation = min(r["generation"] for _, r in Traces.load(trace_dir).events("stepped")
                     if r["size"] == WORKERS and r["generation"] > before)
    target = steps_done(trace_dir) + STEPS_AT_FULL
    wait_until("steps at full size", lambda: steps_done(trace_dir) >= target)
    t = Traces.load(trace_dir)
    idle = [survivor_idle(t.by_pod[pod], fault, generation) for pod in survivors]
    return idle, full


def run_local(workdir: Path, scenario: str, state_mb: int, start_delay: float
              ) -> tuple[list[Idle], float]:
    """The scenario under the local launcher."""
    env = {**WORKLOAD, "TRACE_DIR": str(workdir / "trace"), "BALLAST_MB": str(state_mb)}
    with LocalJob([sys.executable, str(WORKER)], workdir, env=env,
                  restart=scenario == "restart") as job:
        job.start(WORKERS)

        def slow() -> None:
            job.env["START_DELAY_S"] = str(start_delay)

        return measure(Driver(
            trace_dir=workdir / "trace", world=lambda: job.world,
            kill=lambda pod: job.kill(pod, signal.SIGKILL), slow_newcomers=slow,
            replace=(lambda: job.scale(WORKERS)) if scenario == "replace" else None))


def run_podhost(kube: KubeClient, workdir: Path, scenario: str, state_mb: int,
                start_delay: float) -> tuple[list[Idle], float]:
    """The scenario on the local cluster: the operator publishes every world; the pod
    host restarts a killed process in its pod (``restart``), or the pod is deleted and
    the operator creates its replacement (``replace``)."""
    manifest = job_manifest()
    container = manifest["spec"]["workers"]["template"]["spec"]["containers"][0]
    container["env"].append({"name": "BALLAST_MB", "value": str(state_mb)})
    trace_dir = workdir / "trace"
    with job_in(kube, manifest) as namespace:
        host = PodHost(kube, namespace, JOB, [sys.executable, str(WORKER)], workdir / "pods",
                       extra_env={"TRACE_DIR": str(trace_dir)}, readiness_grace=120)
        runner = HostThread(host)
        try:
            def world() -> World:
                got = current_world(kube, namespace, JOB)
                if got is None or got.size != WORKERS:
                    raise BaselineFailed(f"no world of {WORKERS} in {namespace}: {got}")
                return got

            def slow() -> None:
                host.extra_env["START_DELAY_S"] = str(start_delay)

            def kill(pod: str) -> None:
                if scenario == "restart":
                    host.kill(pod, signal.SIGKILL)
                else:
                    kube.delete(api_path("v1", "pods", namespace, pod), grace=0)

            return measure(Driver(trace_dir=trace_dir, world=world, kill=kill,
                                 slow_newcomers=slow, replace=None))
        finally:
            runner.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", default="local,podhost")
    parser.add_argument("--scenarios", default="replace,restart")
    parser.add_argument("--state-mb", type=int, default=100)
    parser.add_argument("--start-delay", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]
    if unknown := [p for p in paths if p not in PATHS]:
        parser.error(f"unknown paths: {unknown}")
    scenarios = [s for s in args.scenarios.split(",") if s]
    if unknown := [s for s in scenarios if s not in ("replace", "restart")]:
        parser.error(f"unknown scenarios: {unknown}")
    base = Path(tempfile.mkdtemp(prefix="ringwright-bench-join-"))
    print(f"workdir {base}; {WORKERS} workers, {args.state_mb} MB of state each, newcomer "
          f"start-up delay {args.start_delay:.1f} s", flush=True)
    head = (f"{'path':18}{'scenario':10}{'join idle s (median / worst)':>32}"
            f"{'failure idle s (median / worst)':>35}{'kill to full s':>16}")
    rows = []
    with contextlib.ExitStack() as stack:
        kube: KubeClient | None = None
        for path in paths:
            if path == "podhost" and kube is None:
                cluster = stack.enter_context(operated_cluster(base))
                kube = stack.enter_context(cluster.client())
            for scenario in scenarios:
                for n in range(args.repeats):
                    work = base / f"{path}-{scenario}-{n}"
                    if path == "local":
                        idle, full = run_local(work, scenario, args.state_mb,
                                               args.start_delay)
                    else:
                        assert kube is not None
                        idle, full = run_podhost(kube, work, scenario, args.state_mb,
                                                 args.start_delay)
                    join = [i.join for i in idle]
                    failure = [i.failure for i in idle]
                    row = (f"{PATHS[path]:18}{scenario:10}"
                           f"{f'{statistics.median(join):.2f} / {max(join):.2f}':>32}"
                           f"{f'{statistics.median(failure):.2f} / {max(failure):.2f}':>35}"
                           f"{full:>16.2f}")
                    print(row, flush=True)
                    rows.append(row)
    print(f"\n{head}\n{'-' * len(head)}\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
