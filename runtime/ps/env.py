"""Where a PS-mode process finds its world, its servers and its settings."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ringwright.kube import KubeClient, KubeConfig, in_cluster_config, load_kubeconfig
from ringwright.world import DEFAULT_PS_PORT, PS_PORT_ENV, Env, World, world_configmap_name

from ..membership.file_source import FileMembershipSource
from ..membership.kube_source import KubeMembershipSource
from ..membership.source import MembershipSource, WorldTimeout
from .serving.consistency import DEFAULT_STALENESS, Consistency, Mode
from .wire.routing import RecoverySettings


class PSEnv:
    """Environment variables of parameter-server mode (all optional)."""

    PORT = PS_PORT_ENV
    REPLICATE_SECONDS = "RINGWRIGHT_PS_REPLICATE_SECONDS"
    CHECKPOINT_DIR = "RINGWRIGHT_PS_CHECKPOINT_DIR"
    CHECKPOINT_VERSIONS = "RINGWRIGHT_PS_CHECKPOINT_VERSIONS"
    RECOVER_SECONDS = "RINGWRIGHT_PS_RECOVER_SECONDS"
    """How long a worker keeps looking for a shard's primary before it fails (30)."""
    SHARDS = Env.PS_SHARDS
    """Shards of the model, fixed for the job's life (the number of servers when unset or
    smaller): a job whose servers may grow sets it to at least their largest number."""


WORLD_POLL_S = 5.0
"""While waiting for a world, beat the stall watchdog this often."""


def wait_until_listed(source: MembershipSource, listed: Callable[[World], bool],
                      timeout: float, beat: Callable[[], None],
                      poll_s: float = WORLD_POLL_S) -> World:
    """The first world for which ``listed`` holds; raises :class:`WorldTimeout` after
    ``timeout`` s. Calls ``beat`` every few seconds: waiting for a world is not a stall."""
    after = -1
    deadline = time.monotonic() + timeout
    while True:
        beat()
        try:
            world = source.wait_for_world(
                after, max(0.0, min(poll_s, deadline - time.monotonic())))
        except WorldTimeout:
            if time.monotonic() >= deadline:
                raise
            continue
        if listed(world):
            return world
        after = world.generation


def ps_port(environ: Mapping[str, str]) -> int:
    return int(environ.get(PSEnv.PORT) or DEFAULT_PS_PORT)


DOWN_ADDRESS = "127.0.0.1:1"
"""Where calls to a server that is down go: refused at once, so clients fail over."""


def ps_addresses(world: World, port: int) -> list[str]:
    """host:port of every parameter server of ``world``, by PS index (a server that is
    down, absent from the world, gets an address that refuses connections)."""
    by_rank = {m.rank: f"{m.ip}:{port}" for m in world.ps}
    return [by_rank.get(i, DOWN_ADDRESS) for i in range(world.ps_count)]


def ps_shards(environ: Mapping[str, str]) -> int:
    """The shard count the environment asks for (0: one per server)."""
    return int(environ.get(PSEnv.SHARDS) or 0)


def recovery_settings(environ: Mapping[str, str]) -> RecoverySettings:
    """A worker's :class:`RecoverySettings`: the deadline and the job's
    failureDetectSeconds from the environment."""
    given = {"deadline_s": environ.get(PSEnv.RECOVER_SECONDS),
             "detect_s": environ.get(Env.FAILURE_DETECT)}
    return RecoverySettings(**{k: float(v) for k, v in given.items() if v})


@dataclass(frozen=True)
class SpecConsistency:
    """spec.ps's consistency settings as the operator passes them."""

    consistency: Consistency
    requeue_stale: bool


def spec_consistency(environ: Mapping[str, str]) -> SpecConsistency | None:
    """The job spec's consistency settings, or None when the environment has none
    (a local run without them keeps what the script declared)."""
    mode = environ.get(Env.PS_CONSISTENCY, "")
    if not mode:
        return None
    parsed = Mode(mode.lower())
    tau = int(environ.get(Env.PS_STALENESS) or DEFAULT_STALENESS)
    backup = int(environ.get(Env.PS_BACKUP_WORKERS) or 0)
    return SpecConsistency(
        Consistency(parsed, tau=tau if parsed is Mode.ASYNC else 0,
                    backup_workers=backup if parsed is Mode.SYNC else 0),
        environ.get(Env.PS_REQUEUE_STALE, "false").lower() == "true")


def membership_source(environ: Mapping[str, str], poll: float = 0.05) -> MembershipSource:
    """The local world file when ``RINGWRIGHT_WORLD_FILE`` is set, else the world ConfigMap."""
    world_file = environ.get(Env.WORLD_FILE, "")
    if world_file:
        return FileMembershipSource(Path(world_file), poll_interval=poll)
    job = environ.get(Env.JOB_NAME, "")
    if not job:
        raise ValueError(f"set {Env.JOB_NAME} (in a pod) or {Env.WORLD_FILE} (locally)")
    config = _kube_config(environ)
    namespace = environ.get(Env.NAMESPACE) or config.namespace

    def client() -> KubeClient:
        return KubeClient(_kube_config(environ))

    return KubeMembershipSource(
        client, namespace, environ.get(Env.WORLD_CONFIGMAP) or world_configmap_name(job))


def _kube_config(environ: Mapping[str, str]) -> KubeConfig:
    kubeconfig = environ.get("KUBECONFIG", "")
    if kubeconfig:
        return load_kubeconfig(kubeconfig.split(os.pathsep)[0])
    return in_cluster_config()
