"""The pod's entry point when a worker pod runs several training processes.

``python -m ringwright.runtime.launch -- python train.py ...`` (the operator wraps the
training container's command in it when ``spec.workers.numProcPerNode`` > 1) starts the
command once per local rank, ``RINGWRIGHT_PROCS_PER_POD`` of them, each with
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``CUDA_VISIBLE_DEVICES`` naming its one GPU
(so ``cuda`` is that GPU in every script). Local rank 0 serves the pod's readiness,
health file and metrics; the others would only collide on the ports.

A pod's ranks live and die together. When one local rank exits with an error or a
signal, the entry point kills the others at once and exits with that rank's status: the
kubelet restarts the container (restartPolicy OnFailure) and its ranks rejoin without
state, or the operator replaces the pod, as for any crashed pod. Restarting one rank in
place would save nothing: every rank of the world rolls back on any death, and a pod
whose process died may hold a GPU in an unknown state (docs/gpu.md). When every rank
exits 0 (the job finished, or the pod left the world) the entry point exits 0. SIGTERM
and SIGINT are forwarded to every rank, which checkpoint and exit within the grace
period.

With ``RINGWRIGHT_FORK_WORKERS=1`` in the pod's environment, a command that runs a
script or module of this interpreter is forked from a server that imported torch once
(:mod:`ringwright.runtime.local.forkserver`) instead of started afresh per rank: a pod
of eight ranks pays for one import of torch, not eight. The server imports torch without
touching CUDA, so each forked rank still sees only its own ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType

from ringwright.world import Env

from .kvlog import log_event, runtime_logger
from .local import forkserver

_log = runtime_logger("launch")

CUDA_VISIBLE = "CUDA_VISIBLE_DEVICES"
PORTS_OF_RANK_ZERO = (Env.READINESS_PORT, Env.METRICS_PORT)
"""Ports only local rank 0 serves (0 turns them off in the others)."""


class LaunchError(ValueError):
    """The pod's settings cannot start its local ranks."""


def local_env(env: Mapping[str, str], local_rank: int, procs: int) -> dict[str, str]:
    """The environment of local rank ``local_rank`` of ``procs``, from the pod's ``env``.

    GPUs: the ``local_rank``-th entry of the pod's ``CUDA_VISIBLE_DEVICES`` when it lists
    them, else GPU ``local_rank`` (the device plugin numbers a container's GPUs from 0).
    """
    out = dict(env)
    out[Env.LOCAL_RANK] = str(local_rank)
    out[Env.LOCAL_WORLD_SIZE] = str(procs)
    out[Env.PROCS_PER_POD] = str(procs)
    visible = [d for d in env.get(CUDA_VISIBLE, "").split(",") if d.strip()]
    if visible and len(visible) < procs:
        raise LaunchError(f"{CUDA_VISIBLE}={env[CUDA_VISIBLE]} lists {len(visible)} GPUs "
                          f"for {procs} local ranks; give the pod one GPU per rank "
                          "(spec.gpusPerWorker) or set spec.workers.numProcPerNode")
    out[CUDA_VISIBLE] = visible[local_rank].strip() if visible else str(local_rank)
    if local_rank:
        for name in PORTS_OF_RANK_ZERO:
            out[name] = "0"
        if env.get(Env.HEALTH_FILE):
            out[Env.HEALTH_FILE] = f"{env[Env.HEALTH_FILE]}.{local_rank}"
    return out


def local_rank_from_env(env: Mapping[str, str]) -> int:
    """``LOCAL_RANK`` as set by the pod's entry point; 0 in a pod of one process.

    A pod meant to run several processes whose command was not started by the entry
    point (the image's own entry point ran) is refused: every process would claim
    local rank 0.
    """
    if not env.get(Env.PROCS_PER_POD, ""):
        return 0  # not in a ringwright pod of several ranks: a LOCAL_RANK is someone else's
    procs = int(env[Env.PROCS_PER_POD])
    text = env.get(Env.LOCAL_RANK, "")
    if not text:
        if procs > 1:
            raise ValueError(
                f"{Env.PROCS_PER_POD}={procs} but {Env.LOCAL_RANK} is not set: the pod's "
                "entry point did not start this process. Set the training container's "
                "command (the operator wraps it in python -m ringwright.runtime.launch) or "
                "spec.workers.numProcPerNode: 1")
        return 0
    local_rank = int(text)
    if not 0 <= local_rank < procs:
        raise ValueError(f"{Env.LOCAL_RANK}={local_rank} is outside 0..{procs - 1} "
                         f"({Env.PROCS_PER_POD}={procs})")
    return local_rank


def exit_status(code: int) -> int:
    """A child's ``returncode`` as a shell would report it (signal N: 128 + N)."""
    return 128 - code if code < 0 else code


@dataclass
class _Rank:
    local_rank: int
    process: forkserver.Process


class PodRanks:
    """The local ranks of one pod, started, watched and stopped together."""

    def __init__(self, command: Sequence[str], env: Mapping[str, str], procs: int,
                 *, poll_s: float = 0.05, fork: bool = False) -> None:
        if procs < 1:
            raise LaunchError(f"{Env.PROCS_PER_POD} must be at least 1, got {procs}")
        if not command:
            raise LaunchError("give the training command after --")
        self.command = list(command)
        self.procs = procs
        self._envs = [local_env(env, k, procs) for k in range(procs)]
        self._poll_s = poll_s
        self._fork = fork
        self._server: forkserver.ForkServer | None = None
        self._ranks: list[_Rank] = []
        self._stopping = False

    def start(self) -> None:
        """Start every local rank."""
        for k, env in enumerate(self._envs):
            proc = self._start(env)
            self._ranks.append(_Rank(k, proc))
            log_event(_log, logging.INFO, "local_rank_started", local_rank=k, pid=proc.pid,
                      gpu=env[CUDA_VISIBLE])

    def _start(self, env: Mapping[str, str]) -> forkserver.Process:
        if not (self._fork and forkserver.forkable(self.command)):
            return subprocess.Popen(self.command, env=env)
        if self._server is None:
            # A SIGTERM to the pod's processes (the pod host signals the group) must let
            # the ranks checkpoint: the server must not kill them on it.
            self._server = forkserver.ForkServer(survive_signals=True)
        return self._server.spawn(self.command, env, stdout=1, stderr=2)

    def stop(self, signum: int) -> None:
        """Forward a termination signal: every rank checkpoints and exits on its own, so
        one rank's exit no longer stops the others."""
        self._stopping = True
        self.signal_all(signum)

    def signal_all(self, signum: int) -> None:
        """Send ``signum`` to every local rank still running."""
        for r in self._ranks:
            if r.process.poll() is None:
                r.process.send_signal(signum)

    def close(self) -> None:
        """Stop the fork server, if the ranks were forked (it kills any still running)."""
        if self._server is not None:
            self._server.close()

    def wait(self) -> int:
        """Wait for the ranks; the pod's exit status (see the module's docstring)."""
        while True:
            codes = [r.process.poll() for r in self._ranks]
            failed = next(((r, c) for r, c in zip(self._ranks, codes, strict=True)
                           if c is not None and c != 0), None)
            if self._stopping and all(c is not None for c in codes):
                return max((exit_status(c) for c in codes if c is not None), default=0)
            if failed is not None and not self._stopping:
                rank, code = failed
                status = exit_status(code)
                log_event(_log, logging.WARNING, "local_rank_failed",
                          local_rank=rank.local_rank, exit_code=status,
                          action="stopping the pod's other ranks")
                self.signal_all(signal.SIGKILL)
                for r in self._ranks:
                    r.process.wait()
                return status
            if all(c == 0 for c in codes):
                log_event(_log, logging.INFO, "local_ranks_done", ranks=self.procs)
                return 0
            time.sleep(self._poll_s)


def main(argv: Sequence[str] | None = None) -> int:
    """Start the pod's local ranks and exit with the pod's status."""
    args = list(sys.argv[1:] if argv is None else argv)
    command = args[1:] if args[:1] == ["--"] else args
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launch %(message)s")
    try:
        procs = int(os.environ.get(Env.PROCS_PER_POD, "") or 1)
        ranks = PodRanks(command, os.environ, procs, fork=forkserver.wanted(os.environ))
    except (LaunchError, ValueError) as err:
        print(f"ringwright.runtime.launch: {err}", file=sys.stderr)
        return 2

    def forward(signum: int, frame: FrameType | None) -> None:
        ranks.stop(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    try:
        ranks.start()
        return ranks.wait()
    finally:
        ranks.close()


if __name__ == "__main__":
    sys.exit(main())
