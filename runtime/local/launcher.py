"""A local stand-in for the operator: real worker processes on loopback addresses.

:class:`LocalJob` starts one process per "pod", each with its own 127.0.0.x address,
and publishes the job's world to a file that the workers follow with the file
membership source. Like the operator it bumps the generation when a worker dies (after a
short settle window, so a burst of deaths yields one generation, or at once when every member
that stays has stopped and waits for it), adds newcomers once they are ready to take
part (each reported ``joining``: started, imports done, waiting for a world that
includes it; :mod:`ringwright.joining`), so the running members keep training while a
newcomer's process starts and switch at a commit, and on a scale-down first publishes
the smaller world and lets the leavers exit on their own.

It learns of faults only as the operator does: from the members' reports (files under
``reports/``) and their exits (a container's exit code, which the API shows), never from
the state of a process it could inspect on this machine. It applies the operator's
rules (:mod:`ringwright.eviction`): a member that its peers found dead (enough of them:
a frozen member answers nobody) or that reports itself stalled is dropped from the world
and killed after a grace period (a cut-off member fences itself first). With
``restart=True`` a crashed process is started again under the same name and address, as
the kubelet restarts a container in its pod: it is dropped from the world like any dead
member and added back as a newcomer once it has reported ``joining``. Every process
started gets its own uid (``RINGWRIGHT_POD_UID``), so one started again never mistakes
its predecessor's entry in a world published before the exit was seen for its own.

Run a script elastically on this machine::

    python -m ringwright.runtime.local.launcher --workers 4 -- python examples/train_elastic.py

``kill -9`` a worker to see the others recover; send the launcher SIGUSR1 to add a
worker and SIGUSR2 to remove one.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import IO

from ringwright.eviction import all_waiting, judge, needs_new_generation
from ringwright.joining import ready_to_join
from ringwright.stragglers import StragglerRule, faster_without, slowness, watch
from ringwright.world import (
    STATS_SUFFIX,
    CheckpointSettings,
    ContractError,
    Env,
    JobRef,
    LRRule,
    LRScaling,
    Member,
    MemberStats,
    Report,
    ReportKind,
    StoreAddress,
    TopologySettings,
    World,
    parse_report,
    parse_stats,
)

from ..kvlog import log_event, runtime_logger
from ..membership.file_source import write_world_file
from . import forkserver
from .pods import LocalPod, Loopback, PodNetwork

_log = runtime_logger("local_launcher")

def write_token(path: Path, token: str) -> None:
    """Write ``token`` to ``path``, readable and writable by the owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token)


def free_port() -> int:
    """A TCP port that is free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalJob:
    """Runs ``command`` as an elastic job of local processes and keeps its world."""

    def __init__(
        self,
        command: Sequence[str],
        workdir: Path,
        *,
        job: str = "local",
        lr: LRScaling | None = None,
        checkpoint: CheckpointSettings | None = None,
        env: Mapping[str, str] | None = None,
        racks: Sequence[str] = (),
        topology: TopologySettings | None = None,
        capture_logs: bool = True,
        settle_s: float = 0.3,
        restart: bool = False,
        network: PodNetwork | None = None,
        verdict_wait_s: float = 4.0,
        evict_grace_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        procs_per_pod: int = 1,
        stragglers: StragglerRule | None = None,
        fork_workers: bool | None = None,
    ) -> None:
        self.command = list(command)
        self.fork_workers = forkserver.wanted() if fork_workers is None else fork_workers
        """Fork worker processes from a fork server that imported torch once (None: as
        ``RINGWRIGHT_FORK_WORKERS`` says); never when measuring start-up times."""
        self.stragglers = stragglers
        """Replace (or drop) members slow for good, by the operator's rule; None: never."""
        self._spares = stragglers.spares if stragglers else 0
        self._slow_since: dict[str, float] = {}
        self.procs_per_pod = procs_per_pod
        """Local ranks per pod: with more than one, each pod runs the pod entry point
        (:mod:`ringwright.runtime.launch`), which starts the command once per rank."""
        self.workdir = workdir
        self.world_file = workdir / "world.json"
        self.job = JobRef(namespace="local", name=job)
        self.lr = lr or LRScaling()
        self.checkpoint = checkpoint or CheckpointSettings()
        self.env = dict(env or {})
        self.racks = tuple(racks)
        """Rack label of pod ``i`` (the i-th started) is ``racks[i]``; none beyond."""
        self.topology = topology or TopologySettings()
        self.capture_logs = capture_logs
        self.settle_s = settle_s
        self.store_port = free_port()
        self.token_file = workdir / "join-token"
        """The job's join token, readable by the owner only, as a mounted Secret is."""
        self.restart = restart
        self.network = network or Loopback()
        self.verdict_wait_s = verdict_wait_s
        self.evict_grace_s = evict_grace_s
        self._clock = clock
        self._wall = wall_clock
        self._lock = threading.RLock()
        self._pods: dict[str, LocalPod] = {}
        self._members: list[str] = []
        self._joining: list[str] = []
        self._next_index = 0
        self._generation = -1
        self._world: World | None = None
        self._failed: dict[str, int] = {}
        self._finished: dict[str, int] = {}
        self._pending_since: float | None = None
        self._last_words: dict[str, Report] = {}
        """The last report of each member whose process exited in the current generation.
        Its restarted process soon replaces it (``joining``), yet what it said about its
        peers before it exited still counts: members that find a peer frozen inside
        ``hvd.init()`` name it and exit one after another, and the first exit must not
        cost the others' votes."""
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="local-job", daemon=True)

    @property
    def world(self) -> World:
        """The world published last."""
        with self._lock:
            if self._world is None:
                raise RuntimeError("no world published yet")
            return self._world

    def pod(self, name: str) -> LocalPod:
        """The process standing in for pod ``name``."""
        with self._lock:
            return self._pods[name]

    def log_path(self, pod: str) -> Path:
        """Where pod ``pod``'s output goes when logs are captured."""
        return self.workdir / "logs" / f"{pod}.log"

    def health_path(self, pod: str) -> Path:
        """Pod ``pod``'s readiness file (present while ready)."""
        return self.workdir / "health" / pod

    @property
    def reports_dir(self) -> Path:
        """Where members write their reports (``<pod>.json``)."""
        return self.workdir / "reports"

    def reports(self) -> dict[str, Report]:
        """Every member's newest report."""
        out: dict[str, Report] = {}
        for path in sorted(self.reports_dir.glob("*.json")):
            report = _read_report(path)
            if report is not None:
                out[path.stem] = report
        return out

    def stats(self) -> dict[str, MemberStats]:
        """Every member's newest measurements (``<pod>.stats`` beside its report)."""
        out: dict[str, MemberStats] = {}
        for path in sorted(self.reports_dir.glob(f"*{STATS_SUFFIX}")):
            try:
                out[path.name.removesuffix(STATS_SUFFIX)] = parse_stats(path.read_text(),
                                                                        where=str(path))
            except (OSError, ContractError):
                continue  # being replaced: read it next round
        return out

    def start(self, workers: int) -> World:
        """Start ``workers`` processes, publish the first world, begin watching them."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        write_token(self.token_file, secrets.token_urlsafe(32))
        with self._lock:
            for _ in range(workers):
                self._members.append(self._spawn().name)
            world = self._publish("start")
        self._monitor.start()
        return world

    def scale(self, workers: int) -> None:
        """A planned resize. Leavers (the last members) are dropped from the world at
        once; newcomers are started now and appended to the world once all have
        reported that they are ready to join."""
        with self._lock:
            while len(self._members) + len(self._joining) < workers:
                self._joining.append(self._spawn().name)
            while self._joining and len(self._members) + len(self._joining) > workers:
                self._signal(self._pods[self._joining.pop()], signal.SIGKILL)
            if len(self._members) > workers:
                while len(self._members) > workers:
                    self._pods[self._members.pop()].leaving = True
                self._publish(f"scale to {workers}")

    def kill(self, pod: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to a worker (SIGKILL: a crash the runtime did not see coming); to
        every process of a pod of several local ranks, as the kubelet stops a container."""
        with self._lock:
            self._signal(self._pods[pod], sig)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Act on nothing while inside, as while the operator is down: no world is
        published, no process restarted or evicted; the processes run on. Whatever
        happened meanwhile is acted on at the end."""
        with self._lock:
            yield

    def _signal(self, pod: LocalPod, sig: int) -> None:
        if self.procs_per_pod > 1 and pod.process.poll() is None:
            forkserver.signal_group(pod.process.pid, sig)
        else:
            pod.process.send_signal(sig)

    def wait(self, timeout: float) -> dict[str, int]:
        """Wait until every member has exited; their exit codes by pod."""
        deadline = self._clock() + timeout
        while self._clock() < deadline:
            with self._lock:
                if all(p.process.poll() is not None for p in self._pods.values()) \
                        and self._pending_since is None:
                    return {name: p.process.returncode for name, p in self._pods.items()
                            if p.process.returncode is not None}
            time.sleep(0.05)
        raise TimeoutError(f"job still running after {timeout:.0f}s; world {self.world.generation}")

    def exit_codes(self) -> dict[str, int | None]:
        """Exit code of every pod ever started (None while running)."""
        with self._lock:
            return {name: p.process.poll() for name, p in self._pods.items()}

    def close(self) -> None:
        """Stop watching and kill whatever still runs."""
        self._stop.set()
        if self._monitor.is_alive():
            self._monitor.join(timeout=5)
        with self._lock:
            for p in self._pods.values():
                if p.process.poll() is None:
                    self._signal(p, signal.SIGKILL)
            for p in self._pods.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.process.wait(timeout=10)

    def __enter__(self) -> LocalJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, index: int | None = None) -> LocalPod:
        if index is None:
            index = self._next_index
            self._next_index += 1
        name = f"{self.job.name}-worker-{index}"
        uid = uuid.uuid4().hex
        ip, prefix, net_env = self.network.attach(index)
        env = {
            **os.environ,
            **self.env,
            **net_env,
            Env.REPORTS_DIR: str(self.reports_dir),
            Env.POD_NAME: name,
            Env.POD_UID: uid,
            Env.POD_IP: ip,
            Env.JOB_NAME: self.job.name,
            Env.NAMESPACE: self.job.namespace,
            Env.WORLD_FILE: str(self.world_file),
            Env.HEALTH_FILE: str(self.health_path(name)),
            Env.JOIN_TOKEN_FILE: str(self.token_file),
        }
        command = self.command
        if self.procs_per_pod > 1:
            env[Env.PROCS_PER_POD] = str(self.procs_per_pod)
            command = [sys.executable, "-m", "ringwright.runtime.launch", "--", *command]
        out: IO[bytes] | None = None
        if self.capture_logs:
            self.log_path(name).parent.mkdir(parents=True, exist_ok=True)
            out = open(self.log_path(name), "ab")  # noqa: SIM115 - owned by the child
        try:
            # A pod of several ranks is a process group, killed as one.
            proc = forkserver.start_process([*prefix, *command], env, output=out,
                                            fork=self.fork_workers,
                                            new_session=self.procs_per_pod > 1)
        finally:
            if out is not None:
                out.close()
        rack = self.racks[index] if index < len(self.racks) else ""
        pod = LocalPod(name=name, ip=ip, index=index, process=proc, uid=uid, rack=rack)
        self._pods[name] = pod
        log_event(_log, logging.INFO, "pod_started", pod=name, ip=ip, pid=proc.pid)
        return pod

    def _publish(self, why: str) -> World:
        self._generation += 1
        per = self.procs_per_pod
        members = tuple(
            Member(rank=i * per + local, pod=name, local_rank=local, ip=self._pods[name].ip,
                   pod_uid=self._pods[name].uid, node="localhost", rack=self._pods[name].rack)
            for i, name in enumerate(self._members) for local in range(per)
        )
        address = members[0].ip if members else "127.0.0.1"
        world = World(job=self.job, generation=self._generation, members=members, lr=self.lr,
                      store=StoreAddress(address=address, port=self.store_port),
                      checkpoint=self.checkpoint, topology=self.topology)
        write_world_file(self.world_file, world)
        self._world = world
        self._last_words = {}
        log_event(_log, logging.INFO, "world_published", generation=world.generation,
                  size=world.size, members=",".join(self._members), why=why)
        return world

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            with self._lock:
                self._check()

    def _check(self) -> None:
        reports = self.reports()  # read once a round
        for name in [p for p in self._joining if self._pods[p].process.poll() is not None]:
            # Died while starting: it never joined, so there is nothing to republish.
            exit_code = self._pods[name].process.wait()
            log_event(_log, logging.WARNING, "pod_failed_starting", pod=name, exit_code=exit_code)
            if self._restarts() and exit_code != 0:
                self._restart(name, exit_code)
            else:
                self._joining.remove(name)
        if self._joining and self._pending_since is None and \
                len(ready_to_join(self._world, reports, self._joining,
                                  {p: self._pods[p].uid for p in self._joining})) \
                == len(self._joining):
            # Every newcomer waits for the next world: the members stop for no start-up.
            self._members += self._joining
            for name in self._joining:
                self._failed.pop(name, None)
            joined, self._joining = ",".join(self._joining), []
            self._publish(f"ready {joined}")
        for name in list(self._members):
            code = self._pods[name].process.poll()
            if code is None or name in self._failed or name in self._finished:
                continue
            if code == 0:
                # A member that finished training; its peers finish at the same step.
                # Processes still starting up would wait for a world that never forms.
                self._finished[name] = code
                log_event(_log, logging.INFO, "pod_finished", pod=name)
                for late in self._joining:
                    self._pods[late].process.terminate()
                self._joining = []
                continue
            self._failed[name] = code
            self._pending_since = self._pending_since or self._clock()
            log_event(_log, logging.WARNING, "pod_failed", pod=name, exit_code=code)
            # Read now: the process is gone, so its report is final until a restart.
            last = _read_report(self.reports_dir / f"{name}.json")
            if last is not None and self._world is not None \
                    and last.generation == self._world.generation:
                self._last_words[name] = last
            if self._restarts():
                self._restart(name, code)
                self._joining.append(name)
        self._follow_reports(reports)
        self._follow_stragglers()
        if self._pending_since is not None and (
                self._clock() - self._pending_since >= self.settle_s
                or self._awaited(reports)):
            gone = [m for m in self._members if m in self._failed]
            self._members = [m for m in self._members if m not in self._failed]
            self._pending_since = None
            self._publish(f"lost {','.join(gone)}")
        for pod in self._pods.values():
            if pod.evicted_at is not None and pod.process.poll() is None \
                    and self._clock() - pod.evicted_at >= self.evict_grace_s:
                # Like deleting the pod: a frozen process cannot fence itself.
                self._signal(pod, signal.SIGKILL)

    def _awaited(self, reports: dict[str, Report]) -> bool:
        """Every member that stays stopped training and waits for the next world (the
        operator's rule: the settle window would keep them all waiting)."""
        world = self._world
        stay = [m for m in self._members if m not in self._failed]
        return world is not None and all_waiting(world, reports, stay)

    def _restarts(self) -> bool:
        """Whether a crashed process is started again: not once a member finished, as the
        operator's completion rule admits no one then (its peers are exiting, so a
        restarted process would wait for a world that never forms)."""
        return self.restart and not self._finished

    def _restart(self, name: str, code: int) -> None:
        """Start ``name``'s process again, as the kubelet restarts a crashed container."""
        old = self._pods[name]
        pod = self._spawn(old.index)
        pod.restarts = old.restarts + 1
        log_event(_log, logging.WARNING, "pod_restarted", pod=name, exit_code=code,
                  restarts=pod.restarts)

    def _follow_reports(self, reports: dict[str, Report]) -> None:
        """Drop members found dead or stalled; re-form around a member without state.

        Judged every round, as the operator does, also while a burst of exits settles:
        the reporters of a frozen member often exit (for a restart) right after naming
        it, and a world published without them but with it would have them all wait
        on a process that never answers."""
        world = self._world
        if world is None:
            return
        # The members' word alone: an exited member is already gone (see _check), and
        # whether a process is frozen is nothing an operator could see.
        doomed = {e.pod: e.reason for e in judge(world, {**reports, **self._last_words})}
        doomed.update({pod: "it reports its training loop stalled"
                       for pod, r in reports.items()
                       if r.kind is ReportKind.STALLED and r.generation == world.generation
                       and pod in self._members})
        dropped = [m for m in self._members if m in doomed and m not in self._failed]
        for name in dropped:
            self._pods[name].evicted_at = self._clock()
            self._failed[name] = -1
            log_event(_log, logging.WARNING, "pod_evicted", pod=name, why=doomed[name])
        if dropped:
            self._pending_since = self._pending_since or self._clock()
            return
        if self._pending_since is not None:
            return
        why = needs_new_generation(world, reports, self._wall(), self.verdict_wait_s)
        if why is not None:
            self._publish(why)


    def _follow_stragglers(self) -> None:
        """Replace a member slow for good with a new process while spares last, else drop
        it when the ring is faster without it (the operator's rule, without nodes)."""
        rule, world = self.stragglers, self._world
        if rule is None or world is None or self._pending_since is not None or self._joining:
            return
        ratios = slowness(self.stats(), world)
        seen = watch(ratios, self._slow_since, factor=rule.factor, window_s=rule.window_s,
                     now=self._wall())
        self._slow_since = seen.since
        if not seen.stragglers:
            return
        slow = seen.stragglers[0]
        replace = self._spares > 0
        if not replace and not faster_without(ratios[slow], len(self._members)):
            return
        if replace:
            self._spares -= 1
            self._joining.append(self._spawn().name)
        # It is slow, not dead: like a scale-down leaver it sees the next world at its
        # next commit and exits.
        self._members.remove(slow)
        self._pods[slow].leaving = True
        self._slow_since = {}
        log_event(_log, logging.WARNING, "straggler", pod=slow, ratio=round(ratios[slow], 2),
                  action="replaced" if replace else "dropped")
        self._publish(f"straggler {slow}")


def _read_report(path: Path) -> Report | None:
    """The report in ``path``; None while it is missing, being replaced or not a report."""
    try:
        return parse_report(path.read_text(), where=str(path))
    except (OSError, ContractError):
        return None


def lr_scaling(rule: str | None, base_world_size: int | None, warmup_steps: int) -> LRScaling:
    """The job's ``spec.lrScaling`` from the command line, with the API server's rule:
    ``linear`` and ``sqrt`` need a base world size. A base world size alone means
    ``linear``, as it always has here; neither means ``none``."""
    chosen = LRRule(rule) if rule is not None else \
        LRRule.LINEAR if base_world_size is not None else LRRule.NONE
    if chosen is not LRRule.NONE and base_world_size is None:
        raise ValueError(f"--lr-rule {chosen.value} needs --base-world-size (the world size "
                         "the learning rate was tuned for)")
    if base_world_size is not None and base_world_size < 1:
        raise ValueError("--base-world-size must be at least 1")
    return LRScaling(rule=chosen, base_world_size=base_world_size or 1,
                     warmup_steps=warmup_steps)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: run a script as a local elastic job until it finishes."""
    parser = argparse.ArgumentParser(
        description="Run a training script as an elastic job of local processes.")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--job", default="local")
    parser.add_argument("--workdir", type=Path, default=Path(".ringwright-local"))
    parser.add_argument("--lr-rule", choices=[r.value for r in LRRule], default=None,
                        help="the job's spec.lrScaling.rule (default: linear with "
                        "--base-world-size, none without)")
    parser.add_argument("--base-world-size", type=int, default=None,
                        help="the world size the script's learning rate was tuned for")
    parser.add_argument("--warmup-steps", type=int, default=0)
    parser.add_argument("--checkpoint-path", default="",
                        help="the job's spec.checkpoint.path: checkpoints with no script code")
    parser.add_argument("--checkpoint-interval-steps", default="0",
                        help="a number of steps (0: not by steps), or Auto (Young/Daly)")
    parser.add_argument("--checkpoint-keep", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--procs-per-pod", type=int, default=1,
                        help="local ranks per pod (spec.workers.numProcPerNode)")
    parser.add_argument("--restart", action="store_true",
                        help="restart a crashed worker under the same name, like a kubelet")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the worker command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the worker command after --")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launcher %(message)s")
    try:
        lr = lr_scaling(args.lr_rule, args.base_world_size, args.warmup_steps)
    except ValueError as err:
        parser.error(str(err))
    auto = args.checkpoint_interval_steps == "Auto"
    if not auto and not args.checkpoint_interval_steps.isdigit():
        parser.error("--checkpoint-interval-steps takes a number >= 0 or Auto, got "
                     f"{args.checkpoint_interval_steps!r}")
    checkpoint = CheckpointSettings(
        path=args.checkpoint_path, keep=args.checkpoint_keep, intervalAuto=auto,
        intervalSteps=0 if auto else int(args.checkpoint_interval_steps))
    with LocalJob(command, args.workdir, job=args.job, lr=lr, checkpoint=checkpoint,
                  capture_logs=False, restart=args.restart,
                  procs_per_pod=args.procs_per_pod) as job:
        def resize(delta: int) -> Callable[[int, FrameType | None], None]:
            def handler(signum: int, frame: FrameType | None) -> None:
                # Off the signal handler: scaling takes the job's lock.
                threading.Thread(target=job.scale,
                                 args=(max(len(job.world.pods) + delta, 1),)).start()
            return handler

        signal.signal(signal.SIGUSR1, resize(+1))
        signal.signal(signal.SIGUSR2, resize(-1))
        job.start(args.workers)
        codes = job.wait(args.timeout)
        finished = all(codes.get(m.pod) == 0 for m in job.world.members)
    log_event(_log, logging.INFO, "job_done", succeeded=finished,
              exit_codes=",".join(f"{pod}:{code}" for pod, code in codes.items()))
    return 0 if finished else 1


if __name__ == "__main__":
    sys.exit(main())
