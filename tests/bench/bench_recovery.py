"""Recovery and join times: ringwright against torchrun elastic, on loopback.

Both systems train the same model on the same data with the same per-worker batch,
the same simulated compute per step and the same commit / checkpoint interval:

* recovery: SIGKILL one of 4 workers (for torchrun, the node's agent and its worker:
  a lost pod) -> the first step completed by the survivors at world size 3;
* join: start 2 workers, scale to 4 -> the first step completed at size 4, timed from
  the newcomers' launch and from the moment they were ready (ringwright: readiness
  file written, i.e. imports done and waiting to join; torchrun: the new agent starts
  its rendezvous);
* whether training state survived, and how (memory vs disk).

torchrun runs with ``--nnodes=MIN:MAX --rdzv-backend=c10d``, once with its default
rendezvous settings (``last_call_timeout`` 30 s) and once with it at 1 s. Prints one
table and the ratios of one run; nothing here asserts on time.

    python tests/bench/bench_recovery.py [--skip-torchrun] [--skip-horovod] [--only-horovod]

The Horovod table puts ringwright with ``backend: horovod`` against Horovod's own
elastic mode (``horovodrun --min-np 3 --max-np 4 --host-discovery-script``, the four
hosts being spellings of 127.0.0.1 so no ssh is involved).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ringwright.runtime.local_launcher import LocalJob, free_port  # noqa: E402
from tests.runtime.elastic_traces import Traces  # noqa: E402

WORKER = ROOT / "tests" / "runtime" / "elastic_worker.py"
KILL_AT_STEP = 20
WAIT_S = 300.0
WORKLOAD = {
    "EPOCHS": "1",
    "SAMPLES": "200000",  # far more than a run trains: no epoch ends mid-measurement
    "BATCH": "4",
    "COMMIT_EVERY": "10",
    "STEP_SLEEP": "0.03",
    "OMP_NUM_THREADS": "1",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
}


@dataclass
class Measure:
    seconds: float | None
    note: str


def wait_until(what: str, probe: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def steps_done(trace_dir: Path) -> int:
    """Highest completed step any worker has recorded (every worker here traces those)."""
    return max((r["step"] for _, r in Traces.load(trace_dir).events("stepped")), default=0)


def first(traces: Traces, ev: str, pred: Callable[[dict[str, Any]], bool]) -> float | None:
    times = [r["t"] for _, r in traces.events(ev) if pred(r)]
    return min(times) if times else None


# ringwright -------------------------------------------------------------------------


def ringwright_recovery(workdir: Path, kill_rank: int, backend: str = "torch") -> Measure:
    env = {**WORKLOAD, "TRACE_DIR": str(workdir / "trace"), "RINGWRIGHT_BACKEND": backend}
    with LocalJob([sys.executable, str(WORKER)], workdir, env=env) as job:
        job.start(4)
        trace_dir = workdir / "trace"
        wait_until("training", lambda: steps_done(trace_dir) >= KILL_AT_STEP)
        victim = job.world.members[kill_rank].pod
        killed_at = time.time()
        job.kill(victim, signal.SIGKILL)
        wait_until("a step at size 3", lambda: first(
            Traces.load(trace_dir), "stepped", lambda r: r["size"] == 3) is not None)
        t = Traces.load(trace_dir)
        done = first(t, "stepped", lambda r: r["size"] == 3)
        assert done is not None
        before = max(r["step"] for pod, r in t.events("stepped")
                     if r["size"] == 4 and pod != victim)
        resumed = {r["step"] for r in t.starts(1).values()}
        return Measure(done - killed_at, f"in memory: resumed at commit {sorted(resumed)}, "
                                         f"{before} steps done before the kill")


def ringwright_join(workdir: Path) -> tuple[Measure, Measure]:
    env = {**WORKLOAD, "TRACE_DIR": str(workdir / "trace")}
    with LocalJob([sys.executable, str(WORKER)], workdir, env=env) as job:
        job.start(2)
        trace_dir = workdir / "trace"
        wait_until("training", lambda: steps_done(trace_dir) >= KILL_AT_STEP)
        launched = time.time()
        job.scale(4)
        wait_until("a step at size 4", lambda: first(
            Traces.load(trace_dir), "stepped", lambda r: r["size"] == 4) is not None)
        newcomers = [m.pod for m in job.world.members[2:]]
        ready = max(job.health_path(p).stat().st_mtime for p in newcomers)
        t = Traces.load(trace_dir)
        done = first(t, "stepped", lambda r: r["size"] == 4)
        assert done is not None
        resumed = {r["step"] for p, r in t.starts(1).items() if p in newcomers}
        note = f"newcomers got step {sorted(resumed)} by broadcast"
        return Measure(done - launched, note), Measure(done - ready, note)


# torchrun ---------------------------------------------------------------------------


class TorchrunJob:
    """One torchrun agent per simulated node, all on 127.0.0.1."""

    def __init__(self, workdir: Path, nodes: str, rdzv_conf: str) -> None:
        self.workdir = workdir
        self.nodes = nodes
        self.rdzv_conf = rdzv_conf
        self.port = free_port()
        self.agents: list[subprocess.Popen[str]] = []
        self.ready_at: dict[int, float] = {}
        self.trace_dir = workdir / "trace"

    def add_agent(self) -> int:
        index = len(self.agents)
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **WORKLOAD, "TRACE_DIR": str(self.trace_dir),
               "BENCH_NODE": str(index), "BENCH_CKPT": str(self.workdir / "ckpt.pt"),
               "LOGLEVEL": "INFO", "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.nodes}",
               "--nproc-per-node=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{self.port}", "--rdzv-id=bench",
               "--max-restarts=10"]
        if self.rdzv_conf:
            cmd.append(f"--rdzv-conf={self.rdzv_conf}")
        cmd += [str(Path(__file__).resolve()), "torchrun-worker"]
        agent = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                 text=True, start_new_session=True)
        self.agents.append(agent)
        threading.Thread(target=self._watch_log, args=(index, agent), daemon=True).start()
        return index

    def _watch_log(self, index: int, agent: subprocess.Popen[str]) -> None:
        assert agent.stderr is not None
        with (self.workdir / f"agent-{index}.log").open("w") as log:
            for line in agent.stderr:
                if "Rendezvous'ing worker group" in line and index not in self.ready_at:
                    self.ready_at[index] = time.time()
                log.write(line)

    def worker_pid(self, node: int) -> int:
        starts = [r for _, r in Traces.load(self.trace_dir).events("start")
                  if r["node"] == node]
        return int(starts[-1]["pid"])

    def kill_node(self, node: int) -> None:
        os.kill(self.worker_pid(node), signal.SIGKILL)
        self.agents[node].kill()

    def close(self) -> None:
        for agent in self.agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()


@contextlib.contextmanager
def torchrun_job(workdir: Path, nodes: str, rdzv_conf: str) -> Iterator[TorchrunJob]:
    job = TorchrunJob(workdir, nodes, rdzv_conf)
    try:
        yield job
    finally:
        job.close()


def start_agents(job: TorchrunJob, count: int) -> None:
    job.add_agent()
    # The first agent must host the rendezvous store: the others only connect to it.
    wait_until("the first agent", lambda: 0 in job.ready_at)
    for _ in range(count - 1):
        job.add_agent()


TORCHRUN_WAIT_S = 240.0
"""How long a torchrun scenario may take to reach its new size before it counts as failed."""


def not_recovered(job: TorchrunJob) -> Measure:
    """The torchrun run never trained at the new size: say what its agents did instead."""
    restarts = sum(log.read_text(errors="replace").count("will restart worker group")
                   for log in job.workdir.glob("agent-*.log"))
    return Measure(None, f"no step at the new size within {TORCHRUN_WAIT_S:.0f} s; the agents "
                         f"restarted their worker groups {restarts} times (logs: {job.workdir})")


def torchrun_recovery(workdir: Path, rdzv_conf: str) -> Measure:
    with torchrun_job(workdir, "3:4", rdzv_conf) as job:
        start_agents(job, 4)
        wait_until("training", lambda: steps_done(job.trace_dir) >= KILL_AT_STEP)
        killed_at = time.time()
        job.kill_node(2)
        try:
            wait_until("a step at size 3", lambda: first(
                Traces.load(job.trace_dir), "stepped", lambda r: r["size"] == 3) is not None,
                timeout=TORCHRUN_WAIT_S)
        except TimeoutError:
            return not_recovered(job)
        t = Traces.load(job.trace_dir)
        done = first(t, "stepped", lambda r: r["size"] == 3)
        assert done is not None
        resumed = {r["step"] for _, r in t.events("start") if r["size"] == 3}
        return Measure(done - killed_at,
                       f"from disk: all workers restarted, resumed at checkpoint {sorted(resumed)}")


def torchrun_join(workdir: Path, rdzv_conf: str) -> tuple[Measure, Measure]:
    with torchrun_job(workdir, "2:4", rdzv_conf) as job:
        start_agents(job, 2)
        wait_until("training", lambda: steps_done(job.trace_dir) >= KILL_AT_STEP)
        launched = time.time()
        job.add_agent()
        job.add_agent()
        try:
            wait_until("a step at size 4", lambda: first(
                Traces.load(job.trace_dir), "stepped", lambda r: r["size"] == 4) is not None,
                timeout=TORCHRUN_WAIT_S)
        except TimeoutError:
            failed = not_recovered(job)
            return failed, failed
        done = first(Traces.load(job.trace_dir), "stepped", lambda r: r["size"] == 4)
        assert done is not None
        ready = max(job.ready_at[2], job.ready_at[3])
        note = "all workers restarted, state from disk"
        return Measure(done - launched, note), Measure(done - ready, note)


def same_model(samples: int) -> tuple[Any, Any, Any, Any]:
    """The elastic tests' data and model, built identically under every launcher."""
    import torch

    from tests.runtime.elastic_worker import FEATURES

    data = torch.Generator().manual_seed(1234)
    xs = torch.randn(samples, FEATURES, generator=data)
    ys = xs @ torch.randn(FEATURES, 1, generator=data) + 0.1
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return xs, ys, model, optimizer


def local_gradients(model: Any, optimizer: Any, sampler: Any, xs: Any, ys: Any) -> list[Any]:
    """This rank's gradients for its share of the next batch (zeros when it has none),
    scaled so that summing them over the world gives the global mean loss's."""
    from ringwright.runtime.flat import gradients

    indices = sampler.batch()
    global_batch = len(sampler.global_positions())
    optimizer.zero_grad()
    if indices:
        (((model(xs[indices]) - ys[indices]) ** 2).sum() / global_batch).backward()
    return gradients(model.parameters())


def torchrun_worker() -> int:
    """The same training step under torchrun: state only survives through a checkpoint."""
    import torch
    import torch.distributed as dist

    from ringwright.runtime.sampler import ElasticSampler
    from tests.runtime.elastic_worker import Trace

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    node = int(os.environ["BENCH_NODE"])
    samples, batch = int(os.environ["SAMPLES"]), int(os.environ["BATCH"])
    commit_every = int(os.environ["COMMIT_EVERY"])
    step_sleep = float(os.environ["STEP_SLEEP"])
    trace = Trace(Path(os.environ["TRACE_DIR"]) /
                  f"torchrun-node{node}-r{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.jsonl")
    # Generous: on a loaded machine the agents start their workers seconds apart.
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    xs, ys, model, optimizer = same_model(samples)
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
                wepoch=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    while True:
        for grad in local_gradients(model, optimizer, sampler, xs, ys):
            dist.all_reduce(grad)
        optimizer.step()
        sampler.advance()
        step += 1
        trace.write(ev="stepped", node=node, size=size, step=step)
        time.sleep(step_sleep)
        if step % commit_every == 0 and rank == 0:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "sampler": sampler.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt)


# horovodrun elastic ----------------------------------------------------------------

# Four spellings of 127.0.0.1: horovodrun runs a host's workers locally, without ssh,
# when the name resolves to an address of this machine.
HOROVOD_HOSTS = ("127.0.0.1", "127.1", "127.0.1", "localhost")


def horovodrun_recovery(workdir: Path, kill_rank: int) -> Measure:
    """Horovod's own elastic mode: a discovery script, a driver, and hvd.elastic.run."""
    workdir.mkdir(parents=True, exist_ok=True)
    hosts = workdir / "hosts"
    hosts.write_text("".join(f"{h}:1\n" for h in HOROVOD_HOSTS))
    discover = workdir / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    trace_dir = workdir / "trace"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    env.update(WORKLOAD, TRACE_DIR=str(trace_dir), PYTHONPATH=str(ROOT),
               HOROVOD_GLOO_TIMEOUT_SECONDS="10")
    horovodrun = Path(sys.executable).with_name("horovodrun")
    cmd = [str(horovodrun), "-np", "4", "--min-np", "3", "--max-np", "4",
           "--host-discovery-script", str(discover), "--network-interface", "lo",
           sys.executable, str(Path(__file__).resolve()), "horovod-worker"]
    with (workdir / "horovodrun.log").open("w") as log:
        run = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True, cwd=workdir)
        try:
            wait_until("training", lambda: steps_done(trace_dir) >= KILL_AT_STEP)
            victim = max((r for _, r in Traces.load(trace_dir).events("start")
                          if r["rank"] == kill_rank), key=lambda r: r["t"])
            # A lost pod: its worker dies and its host leaves the discovery output.
            hosts.write_text("".join(f"{h}:1\n" for h in HOROVOD_HOSTS
                                     if h != victim["host"]))
            killed_at = time.time()
            os.kill(victim["pid"], signal.SIGKILL)
            wait_until("a step at size 3", lambda: first(
                Traces.load(trace_dir), "stepped", lambda r: r["size"] == 3) is not None)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.pid, signal.SIGKILL)
            run.wait()
            # horovodrun starts each worker in a session of its own: end them one by one.
            for _, r in Traces.load(trace_dir).events("start"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(r["pid"], signal.SIGKILL)
    t = Traces.load(trace_dir)
    done = first(t, "stepped", lambda r: r["size"] == 3)
    assert done is not None
    resumed = sorted({r["step"] for _, r in t.events("start") if r["size"] == 3})
    return Measure(done - killed_at, f"in memory (hvd.elastic.TorchState): resumed at {resumed}")


def horovod_worker() -> int:
    """The same training step under horovodrun elastic, written the Horovod way."""
    import horovod.torch as hvd  # type: ignore[import-untyped]

    from ringwright.runtime.sampler import ElasticSampler
    from tests.runtime.elastic_worker import Trace

    hvd.init()
    samples, batch = int(os.environ["SAMPLES"]), int(os.environ["BATCH"])
    commit_every = int(os.environ["COMMIT_EVERY"])
    step_sleep = float(os.environ["STEP_SLEEP"])
    host = os.environ.get("HOROVOD_HOSTNAME", "")
    trace = Trace(Path(os.environ["TRACE_DIR"]) / f"horovod-{os.getpid()}.jsonl")
    xs, ys, model, optimizer = same_model(samples)
    sampler = ElasticSampler(samples, batch, seed=7)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0,
                                   sampler=sampler.state_dict())

    @hvd.elastic.run  # type: ignore[untyped-decorator]
    def train(state: Any) -> None:
        sampler.load_state_dict(state.sampler)
        sampler.set_world(hvd.rank(), hvd.size())
        trace.write(ev="start", rank=hvd.rank(), size=hvd.size(), step=state.step,
                    pid=os.getpid(), host=host)
        while True:
            for i, grad in enumerate(local_gradients(model, optimizer, sampler, xs, ys)):
                hvd.allreduce_(grad, op=hvd.Sum, name=f"grad.{i}")
            optimizer.step()
            sampler.advance()
            state.step += 1
            trace.write(ev="stepped", size=hvd.size(), step=state.step)
            time.sleep(step_sleep)
            if state.step % commit_every == 0:
                state.sampler = sampler.state_dict()
                state.commit()

    train(state)
    return 0


# Report -----------------------------------------------------------------------------


def fmt(m: Measure | None) -> str:
    if m is None or m.seconds is None:
        return "n/a"
    return f"{m.seconds:7.2f} s"


def ratio(a: Measure | None, b: Measure | None) -> str:
    if a is None or b is None or not a.seconds or b.seconds is None:
        return ""
    return f"{b.seconds / a.seconds:6.1f}x"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-torchrun", action="store_true")
    parser.add_argument("--skip-horovod", action="store_true")
    parser.add_argument("--only-horovod", action="store_true",
                        help="just ringwright+horovod against horovodrun elastic")
    args = parser.parse_args(argv)
    if args.only_horovod:
        base = Path(tempfile.mkdtemp(prefix="ringwright-bench-"))
        return horovod_table(base)
    base = Path(tempfile.mkdtemp(prefix="ringwright-bench-"))
    rows: dict[str, dict[str, Measure | None]] = {}
    print(f"workdir {base}; each scenario starts fresh processes", flush=True)

    rows["recovery 4->3, SIGKILL rank 2"] = {"rw": ringwright_recovery(base / "rw-kill2", 2)}
    rows["recovery 4->3, SIGKILL rank 0"] = {"rw": ringwright_recovery(base / "rw-kill0", 0)}
    join_launch, join_ready = ringwright_join(base / "rw-join")
    rows["join 2->4, launch -> step"] = {"rw": join_launch}
    rows["join 2->4, ready -> step"] = {"rw": join_ready}
    if not args.skip_torchrun:
        for label, conf in (("tr", ""), ("tr1", "last_call_timeout=1")):
            print(f"torchrun {conf or 'defaults'} ...", flush=True)
            rows["recovery 4->3, SIGKILL rank 2"][label] = torchrun_recovery(
                base / f"{label}-kill", conf)
            launch, ready = torchrun_join(base / f"{label}-join", conf)
            rows["join 2->4, launch -> step"][label] = launch
            rows["join 2->4, ready -> step"][label] = ready

    head = (f"{'scenario':32} {'ringwright':>10} {'torchrun':>10} {'ratio':>7} "
            f"{'torchrun lc=1s':>14} {'ratio':>7}")
    print("\n" + head + "\n" + "-" * len(head))
    for name, r in rows.items():
        rw, tr, tr1 = r.get("rw"), r.get("tr"), r.get("tr1")
        print(f"{name:32} {fmt(rw):>10} {fmt(tr):>10} {ratio(rw, tr):>7} "
              f"{fmt(tr1):>14} {ratio(rw, tr1):>7}")
    print("\nstate after the change:")
    for name, r in rows.items():
        for label, m in r.items():
            if m is not None:
                print(f"  {name} [{label}]: {m.note}")
    if not args.skip_horovod:
        horovod_table(base)
    print("\ntorchrun's rendezvous store lives in its first agent and losing that agent ends "
          "the job, so the torchrun runs only lose node 2; ringwright moves its store to the "
          "new rank 0.")
    return 0



def horovod_table(base: Path) -> int:
    """Recovery with Horovod doing the collectives: driven by our world vs horovodrun."""
    print("ringwright+horovod and horovodrun elastic ...", flush=True)
    ours = ringwright_recovery(base / "rwh-kill2", 2, backend="horovod")
    theirs = horovodrun_recovery(base / "hvd-kill2", 2)
    head = f"{'scenario':32} {'ringwright+hvd':>14} {'horovodrun':>10} {'ratio':>7}"
    print("\n" + head + "\n" + "-" * len(head))
    print(f"{'recovery 4->3, SIGKILL rank 2':32} {fmt(ours):>14} {fmt(theirs):>10} "
          f"{ratio(ours, theirs):>7}")
    print(f"  ringwright+horovod: {ours.note}\n  horovodrun elastic: {theirs.note}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["torchrun-worker"]:
        sys.exit(torchrun_worker())
    if sys.argv[1:2] == ["horovod-worker"]:
        sys.exit(horovod_worker())
    sys.exit(main())
