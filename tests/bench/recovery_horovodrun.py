"""horovodrun elastic in the recovery benchmark.

``horovodrun --min-np 3 --max-np 4 --host-discovery-script``. Horovod polls the discovery
script once a second (its fixed period); gloo gets the same collective timeout as every
other system. A node loss is its worker dying and its host leaving the discovery output
at once (which helps horovodrun: a cluster's discovery would notice later). A frozen
node (SIGSTOP) or a cut-off one (partition) is not known to the discovery script.

Two setups. SIGKILL, SIGSTOP and straggler: the four hosts are spellings of 127.0.0.1,
so horovodrun runs every worker locally, without ssh. Partition: every host is a network
namespace of its own (``recovery_common.node_network``), and so is the driver, as on a
launch machine of its own on the same switch: cutting a node cuts it from the driver
too. horovodrun reaches a host that is not local with ``ssh HOST COMMAND``; the
benchmark's ``ssh`` (:mod:`tests.bench.namespace_ssh`) carries the command, its output
and its exit status over the hosts' own links, so the cut silences it as it would a
real ssh session without keep-alives.

Rows: discovery that lists the inventory (``cat hosts``), and what a careful user would
arrange instead (``probe``): discovery that also probes each host's worker and kills a
local worker that stopped answering (:mod:`tests.bench.health_probe`), and ssh with
keep-alives (a cut-off host's ``ssh`` exits, so the driver learns that its worker is
lost). Dropping a host from discovery alone does not free horovodrun: it neither ends
that host's worker nor forms a new world without it until that worker has reported.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from ringwright.runtime.local.launcher import free_port
from tests.bench import health_probe
from tests.bench.namespace_ssh import ALIVE_ENV, NamespaceSsh
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
    first_step_at,
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
from tests.runtime.netns import SUBNET, NamespacedPods

ROOT = Path(__file__).resolve().parents[2]
WORKER_SCRIPT = Path(__file__).resolve()
"""The workers run this module (:func:`worker`)."""

# Four spellings of 127.0.0.1: horovodrun runs a host's workers locally, without ssh,
# when the name resolves to an address of this machine.
HOSTS = ("127.0.0.1", "127.1", "127.0.1", "localhost")

CUT_SETTLE_S = 5.0
"""Past this long after a cut, no step of the world of four can still be completing."""

class HorovodrunJob:
    """One horovodrun elastic driver and the discovery file it reads."""

    def __init__(self, workdir: Path, extra_env: dict[str, str] | None = None,
                 network: NamespacedPods | None = None, probe: bool = False) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.trace_dir = workdir / "trace"
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
        env.update(WORKLOAD, **(extra_env or {}), TRACE_DIR=str(self.trace_dir),
                   PYTHONPATH=str(ROOT), HOROVOD_GLOO_TIMEOUT_SECONDS=str(int(PG_TIMEOUT_S)))
        self.host_names: tuple[str, ...] = HOSTS
        self.ssh: NamespaceSsh | None = None
        prefix: list[str] = []
        interface = "lo"
        if network is not None:
            self.ssh = NamespaceSsh(network, len(HOSTS), workdir / "ssh")
            self.host_names = tuple(network.attach(i)[0] for i in range(len(HOSTS)))
            # The driver's namespace: the next one on the bridge.
            prefix = network.attach(len(HOSTS))[1]
            env["PATH"] = f"{self.ssh.bin_dir}{os.pathsep}{env.get('PATH', os.defpath)}"
            interface = "eth0"
        self.hosts = workdir / "hosts"
        self.set_hosts(self.host_names)
        self.discovery_log = workdir / "discovery.jsonl"
        listing = f"cat {self.hosts}"
        if probe:
            # A port per host: on loopback every host is 127.0.0.1.
            ports = workdir / "health-ports.json"
            ports.write_text(json.dumps({h: free_port() for h in self.host_names}))
            env["HEALTH_PORTS_FILE"] = str(ports)
            # ssh -o ServerAliveInterval=1 -o ServerAliveCountMax=3
            env[ALIVE_ENV] = str(LIVENESS_INTERVAL_S * LIVENESS_ATTEMPTS)
            listing = (f"{sys.executable} {Path(health_probe.__file__).resolve()} discover "
                       f"{self.hosts} {ports} {SUBNET}.0/24 {self.discovery_log}")
        discover = workdir / "discover.sh"
        discover.write_text(f"#!/bin/sh\n{listing}\n")
        discover.chmod(0o755)
        # horovodrun's own entry point, run by this interpreter (an overlay venv may
        # have no horovodrun script of its own).
        cmd = [*prefix, sys.executable, "-c", "from horovod.runner.launch import "
               "run_commandline; run_commandline()", "-np", "4",
               "--min-np", "3", "--max-np", "4", "--host-discovery-script", str(discover),
               "--network-interface", interface,
               sys.executable, str(WORKER_SCRIPT), "worker"]
        with (workdir / "horovodrun.log").open("w") as log:
            self.run = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True, cwd=workdir)

    def set_hosts(self, hosts: tuple[str, ...]) -> None:
        self.hosts.write_text("".join(f"{h}:1\n" for h in hosts))

    def victim(self) -> dict[str, Any]:
        """The newest start record of rank VICTIM."""
        return max((r for _, r in Traces.load(self.trace_dir).events("start")
                    if r["rank"] == VICTIM), key=lambda r: r["t"])

    def probe_note(self, host: str, pid: int, since: float) -> str:
        """With a probing discovery: when it first left ``host`` out and killed its
        worker after ``since``, and whether the worker ``pid`` there still exists."""
        if not self.discovery_log.exists():
            return ""
        records = [json.loads(line) for line in self.discovery_log.read_text().splitlines()]

        def first(what: str, happened: Callable[[dict[str, Any]], bool]) -> str:
            at = min((r["t"] for r in records if r["t"] > since and happened(r)), default=None)
            return f"{what} {'never' if at is None else f'after {at - since:.2f} s'}"

        try:
            fate = f"still there ({psutil.Process(pid).status()})"
        except psutil.NoSuchProcess:
            fate = "gone"
        return (f"; probe: {host} {first('dropped', lambda r: host not in r['listed'])}, "
                f"{first('its worker killed', lambda r: host in r['killed'])}; "
                f"that worker {fate} at the end")

    def trained_at_full_size(self) -> bool:
        """Whether the newest completed step was taken by a world of four."""
        stepped = [r for _, r in Traces.load(self.trace_dir).events("stepped")]
        return bool(stepped) and max(stepped, key=lambda r: r["t"])["size"] == len(HOSTS)

    def close(self) -> None:
        # horovodrun starts each worker in a session of its own: end them one by one.
        workers = {r["pid"] for _, r in Traces.load(self.trace_dir).events("start")}
        with contextlib.suppress(psutil.Error):
            workers |= {p.pid for p in psutil.Process(self.run.pid).children(recursive=True)}
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.run.pid, signal.SIGKILL)
        self.run.wait()
        signal_running(workers, WORKER_SCRIPT, signal.SIGKILL)
        if self.ssh is not None:
            self.ssh.close()


@contextlib.contextmanager
def horovodrun_job(workdir: Path, extra_env: dict[str, str] | None = None,
                   network: NamespacedPods | None = None, probe: bool = False
                   ) -> Iterator[HorovodrunJob]:
    """A job that has trained KILL_AT_STEP steps at size four; BaselineFailed if not."""
    job = HorovodrunJob(workdir, extra_env, network, probe)
    try:
        try:
            wait_until("training", lambda: steps_done(job.trace_dir) >= KILL_AT_STEP
                       or job.run.poll() is not None)
        except TimeoutError as err:
            raise BaselineFailed(f"horovodrun did not train: {err}; logs in {workdir}"
                                 ) from err
        if job.run.poll() is not None:
            raise BaselineFailed(f"horovodrun exited {job.run.returncode} before step "
                                 f"{KILL_AT_STEP}; logs in {workdir}")
        if not job.trained_at_full_size():
            raise BaselineFailed(f"horovodrun trained below size {len(HOSTS)} before any "
                                 f"fault; logs in {workdir}")
        yield job
    finally:
        job.close()


def fault(workdir: Path, sig: signal.Signals, probe: bool = False) -> Outcome:
    """Rank VICTIM's worker gets ``sig``; time to the first step at size 3."""
    with horovodrun_job(workdir, probe=probe) as job:
        victim = job.victim()
        if sig == signal.SIGKILL:
            job.set_hosts(tuple(h for h in HOSTS if h != victim["host"]))
        since = time.time()
        if not signal_running([victim["pid"]], WORKER_SCRIPT, sig):
            raise BaselineFailed(f"rank {VICTIM}'s worker (pid {victim['pid']}) is gone "
                                 f"before the fault; logs in {workdir}")
        seconds = time_to_size(job.trace_dir, 3, since,
                               WAIT_S if sig == signal.SIGKILL else FAULT_WAIT_S)
        if seconds is None and sig == signal.SIGKILL:
            raise BaselineFailed(f"horovodrun never trained at size 3 after losing a host; "
                                 f"logs in {workdir}")
        note = job.probe_note(victim["host"], victim["pid"], since)
    rollbacks, lost = losses(workdir / "trace")
    return Outcome(seconds, "in memory (hvd.elastic.TorchState)" + note, rollbacks, lost)


def partition(workdir: Path, probe: bool = False) -> Outcome:
    """Rank VICTIM's host is cut off the network; time to the first step at size 3."""
    with node_network() as nodes, horovodrun_job(workdir, network=nodes, probe=probe) as job:
        victim = job.victim()
        host = victim["host"]
        since = time.time()
        nodes.cut(job.host_names.index(host))
        seconds = time_to_size(job.trace_dir, 3, since, FAULT_WAIT_S)
        # A world of four needs the cut-off host: a step of it well after the cut means
        # the cut did not happen, and "not survived" would be a lie.
        if first_step_at(job.trace_dir, len(HOSTS), since + CUT_SETTLE_S) is not None:
            raise BaselineFailed(f"a world of {len(HOSTS)} still trained after {host} was "
                                 f"cut off; logs in {workdir}")
        note = job.probe_note(host, victim["pid"], since) or ", still in discovery"
    rollbacks, lost = losses(workdir / "trace")
    return Outcome(seconds, f"in memory (hvd.elastic.TorchState); host {host} cut off{note}",
                   rollbacks, lost)


def straggler(workdir: Path, probe: bool = False) -> Outcome:
    """Rank VICTIM pauses once: what it costs the others."""
    with horovodrun_job(workdir, straggler_env(workdir), probe=probe) as job:
        victim = job.victim()
        paused = workdir / "paused"
        wait_until("the pause", paused.exists)
        got = straggler_outcome(job.trace_dir, paused.stat().st_mtime)
        # A slow worker still answers the probe: its host must stay listed.
        return replace(got, note=got.note + job.probe_note(
            victim["host"], victim["pid"], paused.stat().st_mtime))


def worker() -> int:
    """The same training step under horovodrun elastic, written the Horovod way."""
    import horovod.torch as hvd  # type: ignore[import-untyped]

    from ringwright.runtime.sampler import ElasticSampler
    from tests.bench.recovery_step import local_gradients, same_model
    from tests.runtime.elastic_worker import Trace, pause_once

    host = os.environ.get("HOROVOD_HOSTNAME", "")
    ports = os.environ.get("HEALTH_PORTS_FILE")
    if ports:
        # Up before hvd.init(): from the first probe on, this host answers for itself.
        health_probe.serve(host, json.loads(Path(ports).read_text())[host])
    hvd.init()
    samples, batch = int(os.environ["SAMPLES"]), int(os.environ["BATCH"])
    commit_every = int(os.environ["COMMIT_EVERY"])
    step_sleep = float(os.environ["STEP_SLEEP"])
    pause_step = int(os.environ.get("PAUSE_STEP", "-1"))
    trace = Trace(Path(os.environ["TRACE_DIR"]) / f"horovod-{os.getpid()}.jsonl")
    xs, ys, model, optimizer = same_model(samples)
    sampler = ElasticSampler(samples, batch, seed=7)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0,
                                   sampler=sampler.state_dict())
    resets = [0]

    @hvd.elastic.run  # type: ignore[untyped-decorator]
    def train(state: Any) -> None:
        # Each call after a reset is a new world for this worker.
        generation = resets[0]
        resets[0] += 1
        sampler.load_state_dict(state.sampler)
        sampler.set_world(hvd.rank(), hvd.size())
        trace.write(ev="start", rank=hvd.rank(), size=hvd.size(), step=state.step,
                    pid=os.getpid(), host=host, generation=generation)
        while True:
            for i, grad in enumerate(local_gradients(model, optimizer, sampler, xs, ys)):
                hvd.allreduce_(grad, op=hvd.Sum, name=f"grad.{i}")
            optimizer.step()
            sampler.advance()
            state.step += 1
            trace.write(ev="stepped", rank=hvd.rank(), size=hvd.size(), step=state.step,
                        generation=generation)
            time.sleep(step_sleep)
            if state.step == pause_step and hvd.rank() == int(os.environ["PAUSE_RANK"]):
                pause_once(Path(os.environ["PAUSE_FILE"]), float(os.environ["PAUSE_SECONDS"]))
            if state.step % commit_every == 0:
                state.sampler = sampler.state_dict()
                state.commit()

    train(state)
    return 0


if __name__ == "__main__":
    sys.exit(worker())
