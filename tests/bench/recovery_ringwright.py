"""ringwright in the recovery benchmark: the runtime under a local stand-in operator.

The stand-in (:class:`ClusterStyleJob`) must not know more than an operator on a
cluster does. A lost node's pod does not exit where the operator could ``waitpid`` it,
so the stand-in only acts on a death once a surviving member has shown that it noticed
(its training in the current world was interrupted: the evidence a member reports),
and then corroborates it with its own view of the pod (the process is gone). Nothing
else changes: whatever the runtime does to detect failures is what gets measured.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, cast

from ringwright.runtime.local.forkserver import Process
from ringwright.runtime.local.launcher import LocalJob
from ringwright.runtime.local.pods import LocalPod, PodNetwork
from ringwright.runtime.settings import SettingsEnv
from tests.bench.recovery_common import (
    FAULT_WAIT_S,
    IN_PLACE,
    KILL_AT_STEP,
    PG_TIMEOUT_S,
    VICTIM,
    WAIT_S,
    WORKLOAD,
    BaselineFailed,
    Outcome,
    losses,
    next_victim,
    node_network,
    shrink_and_heal,
    steps_done,
    straggler_env,
    straggler_outcome,
    time_to_size,
    wait_until,
    whole_and_training,
)
from tests.runtime.elastic_traces import Traces

WORKER = Path(__file__).resolve().parents[1] / "runtime" / "elastic_worker.py"


class _ExitSeenOnEvidence:
    """A worker process as the stand-in sees it: a failed exit shows only once a peer
    has noticed the failure; clean exits (a member leaving) show at once."""

    def __init__(self, proc: Process, noticed: Any) -> None:
        self._proc = proc
        self._noticed = noticed

    def poll(self) -> int | None:
        code = self._proc.poll()
        if code is None or code == 0 or self._noticed(self._proc.pid):
            return code
        return None

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._proc, name)


class ClusterStyleJob(LocalJob):
    """A :class:`LocalJob` that learns of a death from the survivors, not from waitpid."""

    def __init__(self, workdir: Path, env: dict[str, str],
                 network: PodNetwork | None = None, procs_per_pod: int = 1,
                 restart: bool = False, settle_s: float = 0.3) -> None:
        super().__init__([sys.executable, str(WORKER)], workdir, env=env, network=network,
                         procs_per_pod=procs_per_pod, restart=restart, settle_s=settle_s)
        self.trace_dir = workdir / "trace"

    def __enter__(self) -> ClusterStyleJob:
        return self

    def _spawn(self, index: int | None = None) -> LocalPod:
        pod = super()._spawn(index)
        pod.process = cast(Process, _ExitSeenOnEvidence(pod.process, self._peer_noticed))
        return pod

    def _peer_noticed(self, pid: int) -> bool:
        traces = Traces.load(self.trace_dir)
        generation = self.world.generation
        return any(r["generation"] == generation and pid not in traces.pids(pod)
                   for pod, r in traces.events("interrupted"))


def _env(workdir: Path, backend: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**WORKLOAD, "TRACE_DIR": str(workdir / "trace"), "RINGWRIGHT_BACKEND": backend,
            SettingsEnv.COLLECTIVE_TIMEOUT: str(PG_TIMEOUT_S), **(extra or {})}


def _started(job: ClusterStyleJob, workers: int) -> None:
    job.start(workers)
    wait_until("training", lambda: steps_done(job.trace_dir) >= KILL_AT_STEP)


def fault(workdir: Path, sig: signal.Signals, victim: int = VICTIM, backend: str = "torch"
          ) -> Outcome:
    """Send ``sig`` to the member of rank ``victim`` of four; time the first step at 3."""
    with ClusterStyleJob(workdir, _env(workdir, backend)) as job:
        _started(job, 4)
        pod = job.world.members[victim].pod
        since = time.time()
        job.kill(pod, sig)
        seconds = time_to_size(job.trace_dir, 3, since,
                               WAIT_S if sig == signal.SIGKILL else FAULT_WAIT_S)
        if sig == signal.SIGSTOP:
            job.kill(pod, signal.SIGKILL)
        elif seconds is None:
            raise BaselineFailed(f"ringwright ({backend}) never trained at size 3 after "
                                 f"losing a member; logs in {workdir}")
    rollbacks, lost = losses(workdir / "trace")
    t = Traces.load(workdir / "trace")
    last = t.generations()[-1]
    if last == 0:
        return Outcome(seconds, "no new world formed", rollbacks, lost)
    resumed = sorted({r["step"] for r in t.starts(last).values()})
    return Outcome(seconds, f"state in memory, resumed at step {resumed}", rollbacks, lost)


def partition(workdir: Path, backend: str = "torch") -> Outcome:
    """Cut the member of rank VICTIM of four off the network; time the first step at 3."""
    with node_network() as nodes, \
            ClusterStyleJob(workdir, _env(workdir, backend), network=nodes) as job:
        _started(job, 4)
        victim = job.world.members[VICTIM]
        since = time.time()
        nodes.cut(job.pod(victim.pod).index)
        seconds = time_to_size(job.trace_dir, 3, since, FAULT_WAIT_S)
        code = job.pod(victim.pod).process.poll()
    rollbacks, lost = losses(workdir / "trace")
    fate = "was still running" if code is None else f"exited {code}"
    return Outcome(seconds, f"state in memory; the cut-off member {fate}", rollbacks, lost)


def straggler(workdir: Path, backend: str = "torch") -> Outcome:
    """Rank VICTIM pauses STRAGGLER_S once: what it costs the others."""
    with ClusterStyleJob(workdir, _env(workdir, backend, straggler_env(workdir))) as job:
        _started(job, 4)
        paused = workdir / "paused"
        wait_until("the pause", paused.exists)
        return straggler_outcome(job.trace_dir, paused.stat().st_mtime)


def join(workdir: Path) -> Outcome:
    """Two members, scaled to four: launch of the newcomers -> first step at size 4."""
    with ClusterStyleJob(workdir, _env(workdir, "torch")) as job:
        _started(job, 2)
        since = time.time()
        job.scale(4)
        seconds = time_to_size(job.trace_dir, 4, since, WAIT_S)
        if seconds is None:
            raise BaselineFailed(f"ringwright never trained at size 4; logs in {workdir}")
        newcomers = [m.pod for m in job.world.members[2:]]
    t = Traces.load(workdir / "trace")
    resumed = sorted({r["step"] for p, r in t.starts(t.generations()[-1]).items()
                      if p in newcomers})
    rollbacks, lost = losses(workdir / "trace")
    return Outcome(seconds, f"newcomers got step {resumed} by broadcast", rollbacks, lost)


def pod_kill(workdir: Path, pods: int, procs_per_pod: int) -> tuple[float, float]:
    """SIGKILL every process of the second pod of ``pods`` pods of ``procs_per_pod``
    ranks: seconds from the kill to the first step without it, and from the launch of
    its replacement (as an operator would start one) to the first step back at full
    size."""
    ranks = pods * procs_per_pod
    with ClusterStyleJob(workdir, _env(workdir, "torch"), procs_per_pod=procs_per_pod) as job:
        _started(job, pods)
        victim = job.world.members[procs_per_pod].pod
        since = time.time()
        job.kill(victim, signal.SIGKILL)
        down = time_to_size(job.trace_dir, ranks - procs_per_pod, since, WAIT_S)
        if down is None:
            raise BaselineFailed(f"{pods} pods x {procs_per_pod} ranks never trained without "
                                 f"the killed pod; logs in {workdir}")
        launched = time.time()
        job.scale(pods)
        back = time_to_size(job.trace_dir, ranks, launched, WAIT_S)
        if back is None:
            raise BaselineFailed(f"{pods} pods x {procs_per_pod} ranks never trained at "
                                 f"{ranks} ranks again; logs in {workdir}")
    return down, back


def container_kill(workdir: Path, trials: int, settle_s: float,
                   interval: float) -> list[tuple[float, float, float, str]]:
    """SIGKILL the process of one member of a world of 4 (:func:`next_victim`), once
    per trial; it is started again under its name and address (``restart``, as the
    kubelet restarts a crashed container) and rejoins. Per trial: seconds from the signal
    to the first step by a world of 3 and by a world of 4 again, the 1-minute load
    average at the signal, and how the world became whole (the launcher replaces no
    pod: always the restarted process). The next trial waits for :data:`KILL_AT_STEP`
    more steps."""
    got: list[tuple[float, float, float, str]] = []
    killed: set[str] = set()
    with ClusterStyleJob(workdir, _env(workdir, "torch"), restart=True,
                         settle_s=settle_s) as job:
        job.start(4)
        for _ in range(trials):
            world = whole_and_training(job.trace_dir, lambda: job.world if job.world.size == 4
                                       else None, KILL_AT_STEP, WAIT_S, interval)
            pod = next_victim(world, killed).pod
            killed.add(pod)
            load = os.getloadavg()[0]
            since = time.time()
            job.kill(pod, signal.SIGKILL)
            down, back = shrink_and_heal(job.trace_dir, since, WAIT_S, interval)
            got.append((down, back, load, IN_PLACE))
    return got
