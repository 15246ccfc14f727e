"""The parameter-server process (``RINGWRIGHT_ROLE=ps``).

Follows the job's world: finds its PS index, serves on its pod IP with handler
threads pinned to the pod's CPUs, keeps the sync rounds and data leases in step with
the current workers, sends its primary shards to their replica hosts and checkpoints
them in the background. When the job's servers grow or shrink it hands the shards that
now belong elsewhere to their new homes (:mod:`.serving.moving`). Exits 0 when the data
is done or when it leaves the world (after a shrink, once its shards are handed over).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ringwright.world import Env, World

from ..checkpoint.checkpointer import Checkpointer, ps_shard
from ..checkpoint.storage import storage_for
from ..exiting import freeze_objects_at_exit
from ..kvlog import log_event, runtime_logger
from ..membership.source import MembershipSource
from .env import (
    PSEnv,
    membership_source,
    ps_addresses,
    ps_port,
    recovery_settings,
    wait_until_listed,
)
from .memory import retain_freed_memory
from .metrics import PSMetrics, serve_from_env
from .placement import Placement
from .progress import PSReadiness, ServingProgress
from .serving.moving import Mover
from .serving.replication import GrpcJournal, Replicator, StubSend
from .serving.server import ParameterServer
from .wire.routing import RecoverySettings, Routes
from .wire.transport import DETECT_S, serve

_log = runtime_logger("ps.server")

LOOP_S = 0.1
"""The server's loop follows the world, hand-overs and the data's end at least this
often, however seldom it replicates."""


@dataclass(frozen=True)
class PSSettings:
    replicate_s: float = 0.1
    """How often changed primary shards are sent to their replica hosts (at once after
    the servers change)."""
    checkpoint_dir: str = ""
    """Where primary shards are checkpointed; empty: the job's spec.checkpoint.path."""
    checkpoint_versions: int = 0
    """Checkpoint primary shards every this many versions; 0: as spec.checkpoint says."""
    linger_s: float = 2.0
    """After the data is done, keep serving this long for the last pushes and pulls."""
    drain_s: float = 120.0
    """A server that a shrink took away hands its shards over for at most this long;
    what is still here then fails over to its replicas, as if it had died."""
    world_wait_s: float = 900.0
    detect_s: float = DETECT_S
    """The job's failureDetectSeconds: a replica host that leaves the transport's pings
    unanswered this long fails the replication and journal calls to it."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> PSSettings:
        return cls(float(environ.get(PSEnv.REPLICATE_SECONDS) or 0.1),
                   environ.get(PSEnv.CHECKPOINT_DIR, ""),
                   int(environ.get(PSEnv.CHECKPOINT_VERSIONS) or 0),
                   detect_s=recovery_settings(environ).detect_s)


def pinned_cpus() -> list[int]:
    """The CPUs this pod may use (a Guaranteed pod's whole CPUs), in order."""
    return sorted(os.sched_getaffinity(0))


class ShardCheckpoints:
    """Asynchronous checkpoints of this server's primary shards, one Checkpointer each,
    every ``every`` versions and/or ``seconds`` (of a shard that changed), and the
    restore of a shard from its newest one."""

    def __init__(self, ps: ParameterServer, root: str, every: int = 0, seconds: float = 0.0,
                 keep: int = 3, clock: Callable[[], float] = time.monotonic) -> None:
        self.ps, self.every, self.seconds, self.keep = ps, every, seconds, keep
        self.clock = clock
        self.root = root
        self.storage = storage_for(root)
        self._writers: dict[int, Checkpointer] = {}
        self._saved: dict[int, tuple[int, float]] = {}
        """Per shard: the version last saved (or restored) and when."""
        self._started = clock()

    def _writer(self, shard: int) -> Checkpointer:
        return self._writers.setdefault(
            shard, Checkpointer(self.storage, self.keep, shard=ps_shard(shard)))

    def round(self) -> None:
        now = self.clock()
        for shard in self.ps.primaries():
            version, at = self._saved.get(shard, (0, self._started))
            due = [version + self.every] if self.every else []
            if self.seconds and now - at >= self.seconds:
                due.append(version + 1)
            taken = self.ps.checkpoint_payload(shard, min(due)) if due else None
            if taken is None:
                continue
            version, payload, extra = taken
            self._writer(shard).save(version, payload,
                                     {"epoch": 0, "world_size": 1, **extra}, copy=False)
            self._saved[shard] = (version, now)

    def restore(self, shard: int) -> int | None:
        """Serve ``shard`` from its newest checkpoint; its version, None when none."""
        restored = self._writer(shard).restore_latest()
        if restored is None:
            return None
        self.ps.restore(shard, restored.meta.step, restored.payload, restored.meta.extra)
        self._saved[shard] = (restored.meta.step, self.clock())
        return restored.meta.step

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()


def held_elsewhere(shard: int, addresses: list[str], me: int, detect_s: float) -> bool:
    """Whether a server other than ``me`` holds ``shard`` (primary or replica): then this
    server replaces one that failed and is re-seeded from that copy, which is newer than
    any checkpoint. A server that does not answer holds nothing for this purpose."""
    peers = Routes(addresses, recovery=RecoverySettings(detect_s=detect_s))
    try:
        return any(view is not None and shard in view
                   for index, view in enumerate(peers.views(timeout=2.0)) if index != me)
    finally:
        peers.close()


def shard_checkpoints(ps: ParameterServer, settings: PSSettings, world: World,
                      clock: Callable[[], float]) -> ShardCheckpoints | None:
    """Checkpoints as the environment says, else as the job's spec.checkpoint (its
    path, shared by all pods; intervalSteps counted in versions; intervalSeconds;
    keep); None when neither asks for them."""
    spec = world.checkpoint
    root = settings.checkpoint_dir or spec.path
    every = settings.checkpoint_versions or spec.interval_steps
    if not root or not (every or spec.interval_seconds):
        return None
    return ShardCheckpoints(ps, root, every, spec.interval_seconds, spec.keep, clock)


def run_server(source: MembershipSource, pod: str, port: int, settings: PSSettings,
               *, clock: Callable[[], float] = time.monotonic,
               stop: threading.Event | None = None, metrics: PSMetrics | None = None,
               progress: ServingProgress | None = None) -> int:
    """Serve until the job's data is done or this pod leaves the world; exit status.
    ``progress`` counts the requests served (readiness fails when they stall)."""
    world = wait_until_listed(source, lambda w: any(m.pod == pod for m in w.ps),
                              settings.world_wait_s, progress.tick if progress else lambda: None)
    me = next(m for m in world.ps if m.pod == pod)
    servers = world.ps_count
    cpus = pinned_cpus()
    torch.set_num_threads(len(cpus))
    # A journal sender even alone: the job may grow a server to keep shard 0's replica.
    ps = ParameterServer(me.rank, clock=clock, metrics=metrics,
                         journal=GrpcJournal(detect_s=settings.detect_s))
    # Know the workers before the first push: a sync round must not complete early.
    ps.set_workers(frozenset(m.process for m in world.members))
    checkpoints = shard_checkpoints(ps, settings, world, clock)
    # Before serving: no worker may create the home shard from its own first values.
    if checkpoints is not None and not held_elsewhere(
            me.rank, ps_addresses(world, port), me.rank, settings.detect_s):
        version = checkpoints.restore(me.rank)
        if version is not None:
            log_event(_log, logging.INFO, "ps_restored", shard=me.rank, version=version,
                      root=checkpoints.root)
    server, _ = serve(ps, f"{me.ip}:{port}", threads=max(32, 4 * len(cpus)), cpus=cpus,
                      progress=progress)
    log_event(_log, logging.INFO, "ps_serving", index=me.rank, address=f"{me.ip}:{port}",
              cpus=",".join(map(str, cpus)))
    replicator = Replicator(ps, servers, StubSend(detect_s=settings.detect_s),
                            every_s=settings.replicate_s, clock=clock)
    mover = Mover(ps, StubSend(method="Adopt", detect_s=settings.detect_s),
                  address=f"{me.ip}:{port}")
    done_at: float | None = None
    leaving_at: float | None = None
    try:
        while stop is None or not stop.is_set():
            latest = source.latest() or world
            listed = any(m.pod == pod for m in latest.ps)
            # Taken away by a shrink (its index is past the new count), not dropped as
            # unready or lost: hand the shards over first.
            leaving = not listed and me.rank >= latest.ps_count
            if not listed and (not leaving or _drained(ps, mover, leaving_at, clock,
                                                       settings.drain_s)):
                log_event(_log, logging.INFO, "ps_left_world", generation=latest.generation,
                          primaries=len(ps.primaries()))
                return 0
            if leaving and leaving_at is None:
                leaving_at = clock()
            world = latest
            if world.ps_count != servers:
                mover.resized(servers, world.ps_count)
                log_event(_log, logging.INFO, "ps_resized", servers=servers,
                          to=world.ps_count, hands_over=_listed(mover.pending))
                servers = world.ps_count
            ps.set_workers(frozenset(m.process for m in world.members))
            if progress is not None:
                progress.tick()
            addresses = ps_addresses(world, port)
            replicator.round(addresses)
            mover.round(addresses, replicator)
            if ps.config is not None:
                keeps = Placement(ps.config.shards, servers).keeps
                ps.drop_replicas(functools.partial(keeps, server=me.rank))
            if checkpoints is not None:
                checkpoints.round()
            if ps.finished.is_set():
                done_at = done_at if done_at is not None else clock()
                if clock() - done_at >= settings.linger_s:
                    log_event(_log, logging.INFO, "ps_done", **_summary(ps))
                    return 0
            time.sleep(min(settings.replicate_s, LOOP_S))
        return 0
    finally:
        server.stop(grace=0.5)
        if checkpoints is not None:
            checkpoints.close()


def _drained(ps: ParameterServer, mover: Mover, since: float | None,
             clock: Callable[[], float], drain_s: float) -> bool:
    """Whether a server leaving after a shrink may exit: it handed over every shard it
    served, or it tried for ``drain_s``."""
    if since is None:
        return False
    return not (mover.pending or ps.primaries()) or clock() - since >= drain_s


def _listed(moves: Mapping[int, int]) -> str:
    return ",".join(f"{shard}>{to}" for shard, to in sorted(moves.items())) or "-"


def _summary(ps: ParameterServer) -> dict[str, object]:
    """Counters for the last log line: pushes, staleness, the version of each primary
    shard (``shard:version``), and the data accounting (``epoch:samples`` pairs) when this
    server holds the data-shard service."""
    status = ps.status()

    def pairs(table: Mapping[str, int]) -> str:
        return ",".join(f"{k}:{v}" for k, v in sorted(table.items())) or "-"

    versions = {s: v["version"] for s, v in status["shards"].items() if v["role"] == "primary"}
    out: dict[str, object] = {"applied": status["applied"], "stale": status["stale"],
                              "versions": pairs(versions),
                              "staleness": pairs(status["staleness"]),
                              "dropped_staleness": pairs(status["droppedStaleness"])}
    data = status["data"]
    if data is not None:
        out.update(trained=pairs(data["trained"]), dropped=pairs(data["dropped"]),
                   requeued=pairs(data["requeued"]),
                   requeued_stale=pairs(data["requeuedStale"]))
    return out


def main(environ: Mapping[str, str] | None = None) -> int:
    """Entry point of a PS pod."""
    env = os.environ if environ is None else environ
    pod = env.get(Env.POD_NAME, "")
    if not pod:
        raise ValueError(f"{Env.POD_NAME} is not set")
    retain_freed_memory()
    freeze_objects_at_exit()
    metrics = PSMetrics()
    endpoint = serve_from_env(metrics, env)
    readiness = PSReadiness.from_env(env)
    try:
        return run_server(membership_source(env), pod, ps_port(env), PSSettings.from_env(env),
                          metrics=metrics, progress=readiness.progress)
    finally:
        readiness.close()
        if endpoint is not None:
            endpoint.stop()
