"""Local PS-mode jobs for process tests: a world file plays the operator.

PS ``i`` listens on its own loopback address (127.77.<k>.<i+1>) on one free port, as
pods with their own IPs would; workers and servers are real processes running
examples/ps_wide_and_deep.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ringwright.runtime.local.forkserver import Process, start_process, wanted
from ringwright.runtime.membership.file_source import write_world_file
from ringwright.runtime.ps.env import PSEnv
from ringwright.world import Env, JobRef, Member, Mode, StoreAddress, World

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ps_wide_and_deep.py"

WAIT_S = 300.0
"""How long a wait on progress may take. Generous because the first wait includes
starting every process: with the suite's parallel workers and other users on two cores,
importing torch in five processes has taken over two minutes (a 120 s budget failed
there while the processes were still starting). A passing test never waits it out."""


def consistency(mode: str, tau: int | None = None, backup_workers: int | None = None,
                requeue_stale: bool = False) -> dict[str, str]:
    """The environment the operator sets from spec.ps (consistency, staleness, ...)."""
    env = {Env.PS_CONSISTENCY: mode, Env.PS_REQUEUE_STALE: str(requeue_stale).lower()}
    if tau is not None:
        env[Env.PS_STALENESS] = str(tau)
    if backup_workers is not None:
        env[Env.PS_BACKUP_WORKERS] = str(backup_workers)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class LocalPSJob:
    """PS and worker processes following a world file that the test rewrites."""

    def __init__(self, root: Path, servers: int, args: list[str],
                 env: dict[str, str] | None = None, local_ranks: int = 1) -> None:
        self.root, self.args = root, args
        self.local_ranks = local_ranks
        """Processes per worker pod; with several, each worker pod runs the pod entry
        point as a process group."""
        self.port = free_port()
        # Apart from the PS jobs of concurrent runs: drawn from the system, not from the
        # test's seeded generator (a replayed seed would draw the same subnet every time).
        self.subnet = random.SystemRandom().randint(2, 250)
        self.world_file = root / "world.json"
        self.generation = 0
        self.workers: list[str] = []
        self.ps = [f"ps-{i}" for i in range(servers)]
        self.ps_ip = {p: f"127.77.{self.subnet}.{i + 1}" for i, p in enumerate(self.ps)}
        self.procs: dict[str, Process] = {}
        self.extra_env = env or {}

    def publish(self, workers: list[str] | None = None, ps: dict[str, str] | None = None) -> None:
        """Write the next world: these workers, these PS pods (name -> ip)."""
        if workers is not None:
            self.workers = list(workers)
        if ps is not None:
            self.ps_ip = ps
        self.generation += 1
        world = World(
            job=JobRef(namespace="local", name="ps-test"), generation=self.generation,
            mode=Mode.PARAMETER_SERVER, store=StoreAddress(address="127.0.0.1"),
            members=tuple(Member(rank=i * self.local_ranks + k, pod=w, local_rank=k,
                                 ip="127.0.0.1")
                          for i, w in enumerate(self.workers) for k in range(self.local_ranks)),
            ps=tuple(Member(rank=int(p.rsplit("-", 1)[1]), pod=p, ip=ip)
                     for p, ip in self.ps_ip.items() if p in self.ps),
            ps_replicas=len(self.ps))
        write_world_file(self.world_file, world)

    def start(self, pod: str, role: str, extra: list[str] | None = None) -> None:
        env = {**os.environ, Env.POD_NAME: pod, Env.ROLE: role,
               Env.WORLD_FILE: str(self.world_file), PSEnv.PORT: str(self.port),
               "OMP_NUM_THREADS": "1", **self.extra_env}
        args = [*self.args, *(extra or [])]
        if role == "worker":
            args += ["--trace", str(self.trace(pod))]
        command = [sys.executable, str(EXAMPLE), *args]
        ranks = self.local_ranks if role == "worker" else 1
        if ranks > 1:
            env[Env.PROCS_PER_POD] = str(ranks)
            command = [sys.executable, "-m", "ringwright.runtime.launch", "--", *command]
        log = open(self.root / f"{pod}.log", "ab")  # noqa: SIM115 (the child keeps it)
        self.procs[pod] = start_process(command, env, output=log, cwd=str(self.root),
                                        fork=wanted(), new_session=ranks > 1)
        log.close()

    def resize(self, servers: int) -> None:
        """Grow or shrink the job's servers to ``servers`` and publish it, as the operator
        does: a server taken away is left out of the world (it exits once it has handed
        its shards over); a new one is listed (start its process first, with
        :meth:`start_server`, so that it waits for the world that lists it)."""
        self.ps = [f"ps-{i}" for i in range(servers)]
        self.publish()

    def start_server(self, index: int) -> str:
        """Start PS ``index`` beyond the job's current servers, on its own address, not
        yet listed in the world (its pod is up before the operator lists it)."""
        pod = f"ps-{index}"
        self.ps_ip.setdefault(pod, f"127.77.{self.subnet}.{index + 1}")
        self.start(pod, "ps")
        return pod

    def wait_log(self, pod: str, needle: str, timeout: float = WAIT_S) -> str:
        """The first line of ``pod``'s log that contains ``needle``, once it is there."""
        path = self.root / f"{pod}.log"
        deadline = time.monotonic() + timeout
        while True:
            text = path.read_text() if path.exists() else ""
            for line in text.splitlines():
                if needle in line:
                    return line
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{pod}: no {needle!r} in {timeout}s\n{self.logs()}")
            time.sleep(0.05)

    def start_all(self, workers: list[str], extra: dict[str, list[str]] | None = None) -> None:
        self.publish(workers)
        for p in self.ps:
            self.start(p, "ps")
        for w in workers:
            self.start(w, "worker", (extra or {}).get(w))

    def addresses(self) -> list[str]:
        """host:port of every server, by index (what a worker reads from the world)."""
        return [f"{self.ps_ip[p]}:{self.port}" for p in self.ps]

    def trace(self, pod: str) -> Path:
        return self.root / f"{pod}.trace"

    def steps(self, pod: str) -> list[dict[str, Any]]:
        path = self.trace(pod)
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_steps(self, pod: str, count: int, timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while len(self.steps(pod)) < count:
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{pod}: fewer than {count} steps in {timeout}s\n"
                                   + self.logs())
            time.sleep(0.05)

    def check_alive(self) -> None:
        for pod, proc in self.procs.items():
            if proc.poll() not in (None, 0, -signal.SIGKILL):
                raise AssertionError(f"{pod} exited {proc.returncode}\n{self.logs()}")

    def kill(self, pod: str) -> None:
        if self.local_ranks > 1 and pod in self.workers:
            os.killpg(self.procs[pod].pid, signal.SIGKILL)  # every rank of the pod
        else:
            self.procs[pod].send_signal(signal.SIGKILL)
        self.procs[pod].wait()

    def wait_all(self, timeout: float = WAIT_S) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        codes = {}
        for pod, proc in self.procs.items():
            try:
                codes[pod] = proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as exc:
                raise AssertionError(f"{pod} still running\n{self.logs()}") from exc
        return codes

    def result(self, pod: str) -> dict[str, Any]:
        """The JSON line a worker prints when it stops."""
        for line in reversed((self.root / f"{pod}.log").read_text().splitlines()):
            if line.startswith("{"):
                doc: dict[str, Any] = json.loads(line)
                return doc
        raise AssertionError(f"{pod} printed no result\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p}\n{(self.root / f'{p}.log').read_text()[-3000:]}"
                         for p in self.procs if (self.root / f"{p}.log").exists())

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                if self.local_ranks > 1:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                proc.kill()
                proc.wait()


def load_example() -> Any:
    """examples/ps_wide_and_deep.py as a module (it is a script, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ps_wide_and_deep", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def moved(line: str) -> dict[str, float]:
    """The figures of a ``ps_moved`` log line (shard, to, version, bytes, held_s, at)."""
    import re

    return {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", line.split(" ps_moved ")[1])
            if k in ("shard", "to", "version", "bytes", "held_s", "at")}


def step_overrun(steps: list[dict[str, Any]], at: float) -> float:
    """How much longer than the median step a worker's step in progress at ``at`` (a
    wall-clock time) took, from its trace; 0 when none was."""
    import itertools
    import statistics

    gaps = [(a, b - a) for a, b in itertools.pairwise(s["t"] for s in steps)]
    during = [gap for start, gap in gaps if start <= at < start + gap]
    return during[0] - statistics.median(g for _, g in gaps) if during else 0.0


def ps_done(log: str) -> dict[str, dict[int, int]]:
    """The counters of a PS's ``ps_done`` line: name -> {key: count}."""
    import re

    for line in reversed(log.splitlines()):
        if " ps_done " in line:
            out: dict[str, dict[int, int]] = {}
            for key, value in re.findall(r"(\w+)=(\S+)", line.split(" ps_done ", 1)[1]):
                if ":" in value or value == "-":
                    out[key] = {int(k): int(v) for k, v in
                                (p.split(":") for p in value.split(",") if p != "-")}
            return out
    raise AssertionError("no ps_done line")
