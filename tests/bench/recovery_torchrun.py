"""torchrun elastic (c10d rendezvous) in the recovery benchmark.

One agent per simulated node, all on 127.0.0.1, ``--nnodes=MIN:MAX``. A node loss is
its agent and its worker dying together (SIGKILL or SIGSTOP to both). The workers train
the same model as ringwright's with the same process-group timeout; their state
survives only through the checkpoint rank 0 writes at every commit interval.
Rows: torchrun at its rendezvous defaults, tuned (:data:`TUNED_RDZV`), and tuned with
its workers' process-group timeout at ringwright's failure detection time
(``pg_timeout_s=DETECT_S``): the quickest a frozen peer can be found in a collective,
at the price of taking any peer slower than that for dead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import psutil

from ringwright.runtime.local.launcher import free_port
from tests.bench.recovery_common import (
    FAULT_WAIT_S,
    KILL_AT_STEP,
    LIVENESS_ATTEMPTS,
    LIVENESS_INTERVAL_S,
    PG_TIMEOUT_S,
    VICTIM,
    WAIT_S,
    WORKLOAD,
    BaselineFailed,
    Outcome,
    losses,
    node_network,
    signal_running,
    steps_done,
    straggler_env,
    straggler_outcome,
    time_to_size,
    wait_until,
)
from tests.runtime.elastic_traces import Traces
from tests.runtime.netns import NamespacedPods

ROOT = Path(__file__).resolve().parents[2]
WORKER_SCRIPT = Path(__file__).resolve()
"""The workers run this module (:func:`worker`)."""
TUNED_RDZV = (f"last_call_timeout=1,keep_alive_interval={LIVENESS_INTERVAL_S},"
              f"keep_alive_max_attempt={LIVENESS_ATTEMPTS}")
"""Rendezvous settings that give torchrun the same liveness window as everyone else and
no extra wait once the minimum has arrived."""


class TorchrunJob:
    """One torchrun agent per simulated node."""

    def __init__(self, workdir: Path, nodes: str, rdzv_conf: str,
                 extra_env: dict[str, str] | None = None,
                 network: NamespacedPods | None = None,
                 pg_timeout_s: float = PG_TIMEOUT_S) -> None:
        self.workdir = workdir
        self.network = network
        """Each node in a namespace of its own (else all on 127.0.0.1)."""
        self.nodes = nodes
        self.rdzv_conf = rdzv_conf
        self.extra_env = {**(extra_env or {}), "BENCH_PG_TIMEOUT_S": str(pg_timeout_s)}
        self.port = free_port()
        self.agents: list[subprocess.Popen[str]] = []
        self.trace_dir = workdir / "trace"

    def add_agent(self) -> int:
        """Start the agent of one more node; returns its node index."""
        index = len(self.agents)
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **WORKLOAD, **self.extra_env, "TRACE_DIR": str(self.trace_dir),
               "BENCH_NODE": str(index), "BENCH_CKPT": str(self.workdir / "ckpt.pt"),
               "LOGLEVEL": "INFO", "PYTHONPATH": str(ROOT),
               # Workers then meet on a store of their own per rendezvous round. On the
               # agent's shared store, a worker of a later round can read the addresses
               # its peers published in an earlier one and fail to connect (seen here:
               # groups that restart until the bench gives up).
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        prefix: list[str] = []
        local: list[str] = []
        host, conf = "127.0.0.1", self.rdzv_conf
        if self.network is not None:
            # The first node hosts the rendezvous store, at its own address (torchrun
            # would look for that address among the machine's hostname's, not find it).
            host = self.network.attach(0)[0]
            address, prefix, net_env = self.network.attach(index)
            env.update(net_env)
            local = [f"--local-addr={address}"]
            conf = ",".join(c for c in (conf, f"is_host={int(index == 0)}") if c)
        cmd = [*prefix, sys.executable, "-m", "torch.distributed.run",
               f"--nnodes={self.nodes}", "--nproc-per-node=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint={host}:{self.port}", "--rdzv-id=bench",
               "--max-restarts=100", *local]
        if conf:
            cmd.append(f"--rdzv-conf={conf}")
        cmd += [str(WORKER_SCRIPT), "worker"]
        log = (self.workdir / f"agent-{index}.log").open("w")
        agent = subprocess.Popen(cmd, env=env, stderr=log, stdout=log, text=True,
                                 start_new_session=True)
        log.close()
        self.agents.append(agent)
        return index

    def started(self, count: int) -> None:
        """Start ``count`` agents and wait until they train."""
        self.add_agent()
        # The first agent hosts the rendezvous store: the others only connect to it.
        wait_until("the first agent's store",
                   lambda: "Rendezvous'ing worker group" in self.agent_log(0))
        for _ in range(count - 1):
            self.add_agent()
        wait_until("training", lambda: steps_done(self.trace_dir) >= KILL_AT_STEP)

    def agent_log(self, index: int) -> str:
        path = self.workdir / f"agent-{index}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def worker_pid(self, node: int) -> int:
        starts = [r for _, r in Traces.load(self.trace_dir).events("start")
                  if r["node"] == node]
        return int(starts[-1]["pid"])

    def signal_node(self, node: int, sig: signal.Signals) -> None:
        """The node's agent and worker get ``sig`` together (a lost or frozen machine)."""
        worker = self.worker_pid(node)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.agents[node].pid, sig)
        signal_running([worker], WORKER_SCRIPT, sig)

    def restarts(self) -> int:
        return sum(self.agent_log(i).count("will restart worker group")
                   for i in range(len(self.agents)))

    def close(self) -> None:
        # torchrun starts each worker in a session of its own: end them one by one.
        workers = {r["pid"] for _, r in Traces.load(self.trace_dir).events("start")}
        for agent in self.agents:
            with contextlib.suppress(psutil.Error):
                workers |= {p.pid for p in psutil.Process(agent.pid).children(recursive=True)}
        for agent in self.agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
        signal_running(workers, WORKER_SCRIPT, signal.SIGKILL)


@contextlib.contextmanager
def torchrun_job(workdir: Path, nodes: str, rdzv_conf: str,
                 extra_env: dict[str, str] | None = None,
                 network: NamespacedPods | None = None,
                 pg_timeout_s: float = PG_TIMEOUT_S) -> Iterator[TorchrunJob]:
    """A :class:`TorchrunJob`, every process of it ended on the way out."""
    job = TorchrunJob(workdir, nodes, rdzv_conf, extra_env, network, pg_timeout_s)
    try:
        yield job
    finally:
        job.close()


def fault(workdir: Path, rdzv_conf: str, sig: signal.Signals,
          pg_timeout_s: float = PG_TIMEOUT_S) -> Outcome:
    """Node VICTIM of four gets ``sig``; time to the first step at size 3."""
    with torchrun_job(workdir, "3:4", rdzv_conf, pg_timeout_s=pg_timeout_s) as job:
        job.started(4)
        since = time.time()
        job.signal_node(VICTIM, sig)
        seconds = time_to_size(job.trace_dir, 3, since,
                               WAIT_S if sig == signal.SIGKILL else FAULT_WAIT_S)
        if seconds is None and sig == signal.SIGKILL:
            raise BaselineFailed(f"torchrun ({rdzv_conf or 'defaults'}) never trained at size "
                                 f"3 after losing a node; {job.restarts()} group restarts; "
                                 f"logs in {workdir}")
        restarts = job.restarts()
    rollbacks, lost = losses(workdir / "trace")
    return Outcome(seconds, f"from disk: every worker restarted ({restarts} group restarts)",
                   rollbacks, lost)


def partition(workdir: Path, rdzv_conf: str, pg_timeout_s: float = PG_TIMEOUT_S) -> Outcome:
    """Node VICTIM of four (agent and worker) is cut off the network; time to the first
    step at size 3."""
    with node_network() as nodes, \
            torchrun_job(workdir, "3:4", rdzv_conf, network=nodes,
                         pg_timeout_s=pg_timeout_s) as job:
        job.started(4)
        since = time.time()
        nodes.cut(VICTIM)
        seconds = time_to_size(job.trace_dir, 3, since, FAULT_WAIT_S)
        restarts = job.restarts()
    rollbacks, lost = losses(workdir / "trace")
    return Outcome(seconds, f"from disk: every worker restarted ({restarts} group restarts)",
                   rollbacks, lost)


def straggler(workdir: Path, rdzv_conf: str, pg_timeout_s: float = PG_TIMEOUT_S) -> Outcome:
    """Rank VICTIM pauses once: what it costs the others (with a timeout shorter than
    the pause, the others give up on it and torchrun restarts every worker)."""
    with torchrun_job(workdir, "3:4", rdzv_conf, straggler_env(workdir),
                      pg_timeout_s=pg_timeout_s) as job:
        job.started(4)
        paused = workdir / "paused"
        wait_until("the pause", paused.exists)
        got = straggler_outcome(job.trace_dir, paused.stat().st_mtime)
        return replace(got, note=f"{got.note} ({job.restarts()} group restarts)")


def join(workdir: Path, rdzv_conf: str, pg_timeout_s: float = PG_TIMEOUT_S) -> Outcome:
    """Two nodes, two more agents launched: time to the first step at size 4."""
    with torchrun_job(workdir, "2:4", rdzv_conf, pg_timeout_s=pg_timeout_s) as job:
        job.started(2)
        since = time.time()
        job.add_agent()
        job.add_agent()
        seconds = time_to_size(job.trace_dir, 4, since, WAIT_S)
        if seconds is None:
            raise BaselineFailed(f"torchrun ({rdzv_conf or 'defaults'}) never trained at size "
                                 f"4 after two agents joined; {job.restarts()} group "
                                 f"restarts; logs in {workdir}")
        restarts = job.restarts()
    rollbacks, lost = losses(workdir / "trace")
    return Outcome(seconds, f"from disk: every worker restarted ({restarts} group restarts)",
                   rollbacks, lost)


def worker() -> int:
    """The same training step under torchrun: state survives only through a checkpoint
    (with BALLAST_MB, as elastic_worker.py's, that much more state)."""
    import torch
    import torch.distributed as dist

    from ringwright.runtime.sampler import ElasticSampler
    from tests.bench.recovery_step import local_gradients, same_model
    from tests.runtime.elastic_worker import Trace, pause_once

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    node = int(os.environ["BENCH_NODE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    samples, batch = int(os.environ["SAMPLES"]), int(os.environ["BATCH"])
    commit_every = int(os.environ["COMMIT_EVERY"])
    step_sleep = float(os.environ["STEP_SLEEP"])
    pause_step = int(os.environ.get("PAUSE_STEP", "-1"))
    trace = Trace(Path(os.environ["TRACE_DIR"]) / f"torchrun-node{node}-r{restart}.jsonl")
    # Forming the group may wait for slow starters (the runtime's rendezvous timeout is
    # long too); the collectives get the row's timeout (PG_TIMEOUT_S, as every other
    # system, or DETECT_S).
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    dist.barrier()
    dist.set_timeout(timedelta(seconds=float(os.environ["BENCH_PG_TIMEOUT_S"])))
    xs, ys, model, optimizer = same_model(samples)
    ballast_mb = int(os.environ.get("BALLAST_MB", "0"))
    if ballast_mb:
        # As elastic_worker.py's: state that every checkpoint write and read carries.
        model.register_buffer("ballast", torch.zeros(ballast_mb * 2**20 // 4))
    sampler = ElasticSampler(samples, batch, seed=7)
    step = 0
    ckpt = Path(os.environ["BENCH_CKPT"])
    if ckpt.exists():
        saved = torch.load(ckpt)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        sampler.load_state_dict(saved["sampler"])
        step = saved["step"]
    sampler.set_world(rank, size)
    trace.write(ev="start", node=node, rank=rank, size=size, step=step, pid=os.getpid(),
                generation=restart)
    while True:
        for grad in local_gradients(model, optimizer, sampler, xs, ys):
            dist.all_reduce(grad)
        optimizer.step()
        sampler.advance()
        step += 1
        trace.write(ev="stepped", node=node, rank=rank, size=size, step=step, generation=restart)
        time.sleep(step_sleep)
        if step == pause_step and rank == int(os.environ["PAUSE_RANK"]):
            pause_once(Path(os.environ["PAUSE_FILE"]), float(os.environ["PAUSE_SECONDS"]))
        if step % commit_every == 0 and rank == 0:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "sampler": sampler.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt)


if __name__ == "__main__":
    sys.exit(worker())
