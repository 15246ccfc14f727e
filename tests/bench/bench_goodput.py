"""Goodput under a steady stream of faults: ringwright on the local cluster beside tuned
torchrun on the local launcher.

Four workers of the recovery benchmark's workload (:data:`recovery_common.WORKLOAD`)
with ``--state-mb`` of state each (the workers' ballast buffer: every state broadcast,
checkpoint write and checkpoint read carries it). Once the world of four trains, a
fault every ``--fault-every`` seconds for ``--minutes``, from outside the job, cycling
through :data:`KINDS`:

* ``sigkill``: SIGKILL of one member's training process;
* ``sigstop``: SIGSTOP of one member's training process, which stays stopped (dead to
  its peers; on torchrun the node's agent is stopped with it);
* ``node-loss``: one member's node is lost. On the cluster its KWOK node goes NotReady
  (as the cluster tests make it) and the processes of its pods stop (a lost machine
  answers no one); on torchrun the node's agent and worker are SIGKILLed.

Partitions are left out: the pod host runs every pod's process in the host's network
namespace (127.x pod IPs), so one pod's network cannot be cut alone.

* ringwright: the cluster path (control plane, KWOK nodes, the operator process with
  its own defaults, as the chart runs it: not the tests' short windows; the pod host
  playing the kubelet); the operator replaces every lost member
  (the pod host restarts a killed process in its pod, as a kubelet does). Each worker
  takes a whole KWOK node (8 GPUs), as each torchrun agent is a node of its own. The
  job's SchedulingPolicy gives up on a NotReady node after 4 s (tolerations 10 s), as
  the cluster tests' does; its checkpoint is ``intervalSteps: Auto`` in the work
  folder, the backstop when no member is left with the state; its backoffLimit is
  1000 (the default, 6, would fail the job within the bench's faults).
* torchrun: :class:`recovery_torchrun.TorchrunJob` with :data:`TUNED_RDZV`, nodes
  ``2:4`` (the job's minimum), its workers restarting from the checkpoint rank 0 writes
  every commit interval; a node stopped or lost is replaced by a new agent (as a
  cluster would reschedule it). The node hosting the rendezvous store is never hit
  (its loss ends a torchrun job); likewise ringwright's store host.

Goodput: samples kept (trained in steps that no rollback undid, over steps beyond the
last one done when the window opened) divided by the samples of a fault-free run of the
same system over the same wall time. Read from the workers' ``stepped`` trace records.
Badput, as samples short of the fault-free run: ``rollback`` (samples trained in the
window that were not kept), ``smaller world`` (kept steps trained by fewer than four:
the missing members' shares), and the rest, stalled time, split for ringwright by the
members' own member-seconds in detecting, reforming (restart) and syncing over the
window (the job's ``status.goodput.seconds``).

A baseline that fails (a fault-free run that never trains at four, torchrun not
training again after a SIGKILL) makes the bench exit 1.

    python tests/bench/bench_goodput.py [--minutes 10] [--fault-every 60] [--state-mb 100]
                                        [--systems ringwright,torchrun]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ringwright.devcluster.control_plane import NODE_DOWN_ANNOTATION  # noqa: E402
from ringwright.devcluster.demo import current_world  # noqa: E402
from ringwright.devcluster.podhost import PodHost  # noqa: E402
from ringwright.kube import KubeClient, api_path  # noqa: E402
from ringwright.operator.api.base import API_VERSION  # noqa: E402
from ringwright.operator.api.schedulingpolicy import (  # noqa: E402
    NodeLoss,
    SchedulingPolicy,
    SchedulingPolicySpec,
)
from ringwright.world import World  # noqa: E402
from tests.bench.bench_recovery_paths import (  # noqa: E402
    JOB,
    POLL_S,
    START_S,
    job_in,
    job_manifest,
    operated_cluster,
    world_of,
)
from tests.bench.recovery_common import (  # noqa: E402
    KILL_AT_STEP,
    WORKLOAD,
    BaselineFailed,
    next_victim,
    wait_until,
    whole_and_training,
)
from tests.bench.recovery_torchrun import TUNED_RDZV, TorchrunJob  # noqa: E402
from tests.e2e.test_elastic_job import WORKER, HostThread  # noqa: E402
from tests.jobs import tj_path  # noqa: E402
from tests.runtime.elastic_traces import Traces  # noqa: E402

WORKERS = 4
BATCH = int(WORKLOAD["BATCH"])
"""Samples per rank per step: a step of a world of n trains n x BATCH samples."""
KINDS = ("sigkill", "sigstop", "node-loss")
PATHS = {"ringwright": "local cluster (KWOK + pod host)", "torchrun": "local launcher"}
LOADAVG = Path("/proc/loadavg")
STALLS = {"detecting": "detection", "reforming": "restart", "syncing": "sync"}
"""The runtime's phases (:class:`ringwright.world.Phase`) that stop training, and the
cause each stands for in the badput."""


@dataclass(frozen=True)
class Tally:
    """What one run trained in its window, in samples."""

    kept: int
    trained: int
    smaller: int
    """Of ``kept``'s steps, the shares of the members a smaller world lacked."""


@dataclass
class Run:
    """One system's faulted and fault-free windows."""

    faulted: Tally
    fault_free: Tally
    faults: Counter[str]
    stalls: dict[str, float] = field(default_factory=dict)
    """Member-seconds by phase over the faulted window (ringwright's own stats)."""
    unrecovered: list[str] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        """Samples kept over the fault-free run's."""
        return self.faulted.kept / self.fault_free.kept


def tally(trace_dir: Path, start: float, end: float) -> Tally:
    """Samples trained and kept between ``start`` and ``end`` (see the module).

    Kept steps are found by replaying the records in time order: a record of step s
    means the state was at step s - 1 just before, so any record of a step s or later
    is undone (rolled back); what remains at ``end`` is the state's history."""
    records = sorted((r for _, r in Traces.load(trace_dir).events("stepped")
                      if r["t"] <= end), key=lambda r: r["t"])
    history: list[int] = []  # world size that trained each step (index: step - 1)
    for r in records:
        step = r["step"]
        del history[step - 1:]
        history += [0] * (step - 1 - len(history)) + [r["size"]]
    before = max((r["step"] for r in records if r["t"] <= start), default=0)
    kept = history[before:]
    return Tally(kept=BATCH * sum(kept),
                 trained=BATCH * sum(1 for r in records if r["t"] > start),
                 smaller=BATCH * sum(WORKERS - n for n in kept if n < WORKERS))


def unrecovered(trace_dir: Path, faults: list[tuple[float, str]], end: float) -> list[str]:
    """The faults after which no step completed before the next fault (or the end)."""
    times = [r["t"] for _, r in Traces.load(trace_dir).events("stepped")]
    bounds = [t for t, _ in faults[1:]] + [end]
    return [f"{kind} at +{t - faults[0][0]:.0f} s" for (t, kind), until in zip(
        faults, bounds, strict=True) if not any(t < s <= until for s in times)]


def schedule(start: float, minutes: float, every: float, inject: Callable[[int], str]
             ) -> list[tuple[float, str]]:
    """Call ``inject(k)`` at ``start + k * every`` while that is inside the window;
    returns when and what each fault was. Returns at the window's end."""
    end = start + minutes * 60
    done = []
    k = 0
    while start + k * every < end:
        time.sleep(max(start + k * every - time.time(), 0))
        at = time.time()
        done.append((at, inject(k)))
        k += 1
    time.sleep(max(end - time.time(), 0))
    return done


# -- ringwright on the local cluster --------------------------------------------------


def set_node_down(kube: KubeClient, node: str, down: bool) -> None:
    """KWOK reports ``node`` NotReady while the annotation is set (the cluster tests')."""
    kube.merge_patch(api_path("v1", "nodes", name=node), {"metadata": {"annotations": {
        NODE_DOWN_ANNOTATION: "true" if down else None}}})


@contextlib.contextmanager
def fast_node_loss(kube: KubeClient) -> Iterator[str]:
    """A SchedulingPolicy that gives up on a lost node in seconds; its name."""
    name = "bench-goodput-node-loss"
    policy = SchedulingPolicy(metadata={"name": name}, spec=SchedulingPolicySpec(
        node_loss=NodeLoss(toleration_seconds=10, unready_seconds=4)))
    kube.create(api_path(API_VERSION, "schedulingpolicies"), policy.to_wire())
    try:
        yield name
    finally:
        kube.delete(api_path(API_VERSION, "schedulingpolicies", name=name))


def phase_seconds(kube: KubeClient, namespace: str) -> dict[str, float]:
    """The job's member-seconds by phase so far (its ``status.goodput.seconds``)."""
    job = kube.get(tj_path(namespace, JOB))
    return dict(((job.get("status") or {}).get("goodput") or {}).get("seconds") or {})


def ringwright_window(kube: KubeClient, work: Path, policy: str, state_mb: int,
                      minutes: float, every: float, faulty: bool
                      ) -> tuple[Tally, Counter[str], dict[str, float], list[str]]:
    """One window of the job on the cluster: its tally, the faults by kind, the
    member-seconds by phase over the window, and the faults it did not recover from."""
    manifest = job_manifest(policy)
    # A whole node per worker (KWOK nodes have 8 GPUs), as torchrun's one agent per
    # node: a lost node takes one member, not the three the packing would put on it.
    manifest["spec"]["gpusPerWorker"] = 8
    manifest["spec"]["workers"]["numProcPerNode"] = 1
    # The product's checkpoint, as a user would set it: the job's own backstop when
    # faults leave no member with the state (torchrun has its checkpoint too).
    manifest["spec"]["checkpoint"] = {"path": str(work / "ckpt"), "intervalSteps": "Auto"}
    # A fault a minute is the point here, not a job to give up on: room for every
    # replacement (torchrun gets --max-restarts=100).
    manifest["spec"]["runPolicy"] = {"backoffLimit": 1000}
    container = manifest["spec"]["workers"]["template"]["spec"]["containers"][0]
    container["env"].append({"name": "BALLAST_MB", "value": str(state_mb)})
    trace_dir = work / "trace"
    down: set[str] = set()
    with job_in(kube, manifest) as namespace:
        host = PodHost(kube, namespace, JOB, [sys.executable, str(WORKER)], work / "pods",
                       extra_env={"TRACE_DIR": str(trace_dir)}, readiness_grace=120)
        runner = HostThread(host)
        try:
            def whole() -> World | None:
                return world_of(kube, namespace, WORKERS)

            try:
                whole_and_training(trace_dir, whole, KILL_AT_STEP, START_S, POLL_S)
            except TimeoutError as err:
                raise BaselineFailed(f"ringwright never trained at {WORKERS}: {err}; "
                                     f"traces in {trace_dir}") from err
            hit: set[str] = set()

            def inject(k: int) -> str:
                for node in down:  # the last lost node is back (a repaired machine)
                    set_node_down(kube, node, False)
                down.clear()
                kind = KINDS[k % len(KINDS)]
                world = current_world(kube, namespace, JOB)
                if world is None:
                    return "none"
                victim = next_victim(world, hit)
                hit.add(victim.pod)
                pods = [victim.pod]
                if kind == "node-loss":
                    set_node_down(kube, victim.node, True)
                    down.add(victim.node)
                    pods = [m.pod for m in world.members if m.node == victim.node]
                sig = signal.SIGKILL if kind == "sigkill" else signal.SIGSTOP
                for pod in pods:
                    # The pod host's own handle on the process: never a stale PID.
                    with contextlib.suppress(KeyError):
                        host.kill(pod, sig)
                print(f"    +{time.time() - start:5.0f} s {kind} {', '.join(pods)} "
                      f"(world {world.generation} of {world.size})", flush=True)
                return kind

            before = phase_seconds(kube, namespace)
            start = time.time()
            faults = schedule(start, minutes, every, inject if faulty else lambda k: "none")
            end = start + minutes * 60
            after = phase_seconds(kube, namespace)
        finally:
            runner.close()
            for node in down:
                set_node_down(kube, node, False)
    faults = [f for f in faults if f[1] != "none"]
    stalls = {p: after.get(p, 0.0) - before.get(p, 0.0) for p in (*STALLS, "replaying")}
    return (tally(trace_dir, start, end), Counter(kind for _, kind in faults), stalls,
            unrecovered(trace_dir, faults, end) if faults else [])


def run_ringwright(work: Path, state_mb: int, minutes: float, every: float) -> Run:
    """The fault-free window, then the faulted one, each a job of its own on one cluster."""
    with operated_cluster(work, settings={}) as cluster, cluster.client() as kube, \
            fast_node_loss(kube) as policy:
        print("  ringwright, fault-free ...", flush=True)
        clean, *_ = ringwright_window(kube, work / "clean", policy, state_mb, minutes,
                                      every, faulty=False)
        print("  ringwright, faulted ...", flush=True)
        faulted, faults, stalls, missed = ringwright_window(
            kube, work / "faulted", policy, state_mb, minutes, every, faulty=True)
    if clean.kept == 0:
        raise BaselineFailed("ringwright's fault-free run kept no samples")
    return Run(faulted, clean, faults, stalls, missed)


# -- torchrun on the local launcher ---------------------------------------------------


class Torchrun(TorchrunJob):
    """A torchrun job whose processes the bench signals through handles only: the
    agents' ``Popen`` objects and ``psutil`` handles on their workers (which check that
    a PID still names the process they were taken from)."""

    def __init__(self, workdir: Path, state_mb: int) -> None:
        super().__init__(workdir, f"2:{WORKERS}", TUNED_RDZV,
                         extra_env={"BALLAST_MB": str(state_mb)})
        self.lost: set[int] = set()
        self.frozen: list[psutil.Process] = []

    def workers(self, node: int) -> list[psutil.Process]:
        """The worker processes agent ``node`` runs now."""
        with contextlib.suppress(psutil.Error):
            return [p for p in psutil.Process(self.agents[node].pid).children(recursive=True)
                    if "worker" in p.cmdline()]
        return []

    def fault(self, node: int, kind: str) -> None:
        """``kind`` at ``node``; a stopped or lost node is replaced by a new agent."""
        workers: list[psutil.Process] = []

        def found() -> bool:
            workers[:] = self.workers(node)
            return bool(workers)

        with contextlib.suppress(TimeoutError):
            # Between group restarts a node briefly has no worker.
            wait_until("a worker", found, 10, 0.1)
        sig = signal.SIGKILL if kind in ("sigkill", "node-loss") else signal.SIGSTOP
        if kind != "sigkill":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.agents[node].pid, sig)
            self.lost.add(node)
        for proc in workers:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(sig)
        if sig == signal.SIGSTOP:
            self.frozen += workers
        if kind != "sigkill":
            self.add_agent()

    def close(self) -> None:
        procs = [p for node in range(len(self.agents)) for p in self.workers(node)]
        for agent in self.agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
        for proc in procs + self.frozen:
            with contextlib.suppress(psutil.Error):
                proc.kill()


def torchrun_window(work: Path, state_mb: int, minutes: float, every: float, faulty: bool
                    ) -> tuple[Tally, Counter[str], list[str]]:
    """One window of torchrun: its tally, the faults by kind, those not recovered."""
    job = Torchrun(work, state_mb)
    try:
        job.started(WORKERS)

        def at_full() -> bool:
            # The latest KILL_AT_STEP steps were all trained by a world of four.
            stepped = sorted((r["t"], r["size"]) for _, r in
                             Traces.load(job.trace_dir).events("stepped"))
            last = stepped[-WORKERS * KILL_AT_STEP:]
            return len(last) == WORKERS * KILL_AT_STEP and all(n == WORKERS for _, n in last)

        try:
            wait_until(f"training at {WORKERS}", at_full, START_S, POLL_S)
        except TimeoutError as err:
            raise BaselineFailed(f"torchrun never trained at {WORKERS}: {err}; logs in "
                                 f"{work}") from err
        turn = 0

        def inject(k: int) -> str:
            nonlocal turn
            kind = KINDS[k % len(KINDS)]
            # Node 0 hosts the rendezvous store: its loss ends a torchrun job.
            live = [n for n in range(1, len(job.agents)) if n not in job.lost]
            node = live[turn % len(live)]
            turn += 1
            job.fault(node, kind)
            print(f"    +{time.time() - start:5.0f} s {kind} node {node}", flush=True)
            return kind

        start = time.time()
        faults = schedule(start, minutes, every, inject if faulty else lambda k: "none")
        end = start + minutes * 60
        restarts = job.restarts()
    finally:
        job.close()
    faults = [f for f in faults if f[1] != "none"]
    missed = unrecovered(job.trace_dir, faults, end) if faults else []
    if any(m.startswith("sigkill") for m in missed):
        raise BaselineFailed(f"torchrun did not train again after {missed}; "
                             f"{restarts} group restarts; logs in {work}")
    return tally(job.trace_dir, start, end), Counter(k for _, k in faults), missed


def run_torchrun(work: Path, state_mb: int, minutes: float, every: float) -> Run:
    """The fault-free window, then the faulted one."""
    print("  torchrun, fault-free ...", flush=True)
    clean, _, _ = torchrun_window(work / "clean", state_mb, minutes, every, faulty=False)
    if clean.kept == 0:
        raise BaselineFailed("torchrun's fault-free run kept no samples")
    print("  torchrun, faulted ...", flush=True)
    faulted, faults, missed = torchrun_window(work / "faulted", state_mb, minutes, every,
                                              faulty=True)
    return Run(faulted, clean, faults, unrecovered=missed)


# -- the report -----------------------------------------------------------------------


def badput(run: Run) -> list[tuple[str, int]]:
    """Samples short of the fault-free run, by cause (see the module)."""
    short = run.fault_free.kept - run.faulted.kept
    rollback = run.faulted.trained - run.faulted.kept
    smaller = run.faulted.smaller
    stalled = short - rollback - smaller
    total = sum(run.stalls.get(p, 0.0) for p in STALLS)
    if not total:
        return [("rollback", rollback), ("smaller world", smaller), ("stalled", stalled)]
    return [(STALLS[p], round(stalled * run.stalls.get(p, 0.0) / total)) for p in STALLS] + \
        [("rollback", rollback), ("smaller world", smaller)]


def times(a: float, b: float) -> str:
    """``a`` as a multiple of ``b``."""
    return f"{a / b:.2f}x" if b else "- (torchrun kept nothing)"


def report(runs: dict[str, Run], command: str, started: str, loads: tuple[str, str]
           ) -> None:
    """The table, then the badput by cause."""
    head = (f"{'system':12}{'path':34}{'faults':>34}{'kept':>10}{'fault-free':>12}"
            f"{'goodput':>9}")
    print(f"\n{started}; {command}\n{os.cpu_count()} CPUs; load {loads[0]} before, "
          f"{loads[1]} after\n\n{head}\n{'-' * len(head)}")
    for system, run in runs.items():
        faults = ", ".join(f"{n} {k}" for k, n in sorted(run.faults.items())) or "-"
        print(f"{system:12}{PATHS[system]:34}{faults:>34}{run.faulted.kept:>10}"
              f"{run.fault_free.kept:>12}{run.goodput:>9.1%}")
    if len(runs) == 2:
        rw, tr = runs["ringwright"], runs["torchrun"]
        # Goodput is against each system's own fault-free run; what each kept in
        # absolute terms also shows what torchrun's checkpoint writes cost it.
        print(f"\nringwright / torchrun: goodput {times(rw.goodput, tr.goodput)}; samples "
              f"kept {times(rw.faulted.kept, tr.faulted.kept)}; fault-free samples "
              f"{times(rw.fault_free.kept, tr.fault_free.kept)}")
    for system, run in runs.items():
        short = run.fault_free.kept - run.faulted.kept
        causes = ", ".join(f"{cause} {n} ({n / run.fault_free.kept:.1%})"
                           for cause, n in badput(run))
        print(f"\n{system} badput, samples short of fault-free: {short} "
              f"({short / run.fault_free.kept:.1%}): {causes}")
        if run.stalls:
            print("  member-seconds over the faulted window: " + ", ".join(
                f"{p} {s:.1f}" for p, s in run.stalls.items()))
        if run.unrecovered:
            print(f"  no step before the next fault after: {', '.join(run.unrecovered)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--fault-every", type=float, default=60.0)
    parser.add_argument("--state-mb", type=int, default=100)
    parser.add_argument("--systems", default="ringwright,torchrun")
    args = parser.parse_args(argv)
    # Stopped with SIGTERM, the bench still unwinds: its cluster, pods and agents go.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    systems = [s for s in args.systems.split(",") if s]
    if unknown := [s for s in systems if s not in PATHS]:
        parser.error(f"unknown systems: {unknown}")
    command = (f"python tests/bench/bench_goodput.py --minutes {args.minutes:g} "
               f"--fault-every {args.fault_every:g} --state-mb {args.state_mb} "
               f"--systems {','.join(systems)}")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_before = LOADAVG.read_text().split()[:3]
    work = Path(tempfile.mkdtemp(prefix="ringwright-bench-goodput-"))
    print(f"workdir {work}; {WORKERS} workers, {args.state_mb} MB of state each; a fault "
          f"every {args.fault_every:g} s for {args.minutes:g} min ({', '.join(KINDS)})",
          flush=True)
    runs: dict[str, Run] = {}
    failed = []
    for system in systems:
        print(f"{system} ...", flush=True)
        try:
            runner = run_ringwright if system == "ringwright" else run_torchrun
            runs[system] = runner(work / system, args.state_mb, args.minutes,
                                  args.fault_every)
        except Exception as err:
            # A failed baseline voids the comparison: no figure, exit 1.
            traceback.print_exc()
            failed.append(f"{system}: {err}")
    load_after = LOADAVG.read_text().split()[:3]
    if runs:
        report(runs, command, started, (" ".join(load_before), " ".join(load_after)))
    if failed:
        print("\nFAILED:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
