"""Runtime settings: typed, documented, validated once at start-up."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from ringwright.world import Env


class SettingsEnv:
    """Environment variables that tune the runtime (all optional)."""

    FAILURE_DETECT = Env.FAILURE_DETECT
    COLLECTIVE_TIMEOUT = Env.COLLECTIVE_TIMEOUT
    GROUP_INIT_TIMEOUT = "RINGWRIGHT_GROUP_INIT_TIMEOUT_SECONDS"
    RENDEZVOUS_TIMEOUT = "RINGWRIGHT_RENDEZVOUS_TIMEOUT_SECONDS"
    WORLD_WAIT_TIMEOUT = "RINGWRIGHT_WORLD_WAIT_TIMEOUT_SECONDS"
    FENCE_TIMEOUT = "RINGWRIGHT_FENCE_TIMEOUT_SECONDS"
    STALL_TIMEOUT = Env.STALL_TIMEOUT
    READINESS_PORT = Env.READINESS_PORT
    STATS_INTERVAL = "RINGWRIGHT_STATS_INTERVAL_SECONDS"


class RuntimeSettings(BaseModel):
    """How quickly the runtime gives up on peers, worlds and its own training loop."""

    model_config = ConfigDict(frozen=True)

    failure_detect_s: Annotated[float, Field(gt=0)] = 3.0
    """A member whose heartbeats stop for this long is dead: its peers abort the
    collective they wait in and roll back. Heartbeats run on a side thread, so a slow
    training loop never looks dead."""

    collective_timeout_s: Annotated[float, Field(gt=0)] = 1800.0
    """Last-resort limit for one collective. Long on purpose: a late peer that still
    heartbeats is slow, not dead, and its peers wait for it; death is found by the
    heartbeats within ``failure_detect_s``."""

    group_init_timeout_s: Annotated[float, Field(gt=0)] = 60.0
    """Limit for creating the library's group (connecting every pair, NCCL
    communicator init) once every member has passed the join barrier."""

    rendezvous_timeout_s: Annotated[float, Field(gt=0)] = 300.0
    """How long members of a new world wait for each other to arrive. It must cover a
    commit interval: on a planned scale-up the newcomers wait until the survivors
    reach their next commit."""

    world_wait_timeout_s: Annotated[float, Field(gt=0)] = 900.0
    """How long to wait for a world that includes this pod, or for a newer world after a
    failure, before giving up with a non-zero exit."""

    fence_timeout_s: Annotated[float, Field(gt=0)] = 120.0
    """After a failure, how long a member waits for a newer world that includes it
    before fencing itself (exit non-zero) rather than risk training beside the rest."""

    stall_timeout_s: Annotated[float, Field(ge=0)] = 300.0
    """Readiness fails when the training loop has not advanced for this long; 0 disables."""

    readiness_port: Annotated[int, Field(ge=0, le=65535)] = 0
    """Serve ``/readyz`` and ``/healthz`` over HTTP on this port; 0 disables."""

    readiness_address: str = "0.0.0.0"
    """Address the readiness endpoint listens on: the pod's IP when known, so that
    pods standing in on one machine's loopback addresses do not collide."""

    metrics_port: Annotated[int, Field(ge=0, le=65535)] = 0
    """Serve Prometheus metrics at ``/metrics`` over HTTP on this port; 0 disables."""

    metrics_address: str = "0.0.0.0"
    """Address the metrics server binds: the pod's IP when the operator sets it."""

    termination_grace_s: Annotated[float, Field(gt=0)] = 30.0
    """The pod's terminationGracePeriodSeconds: how long after SIGTERM a final
    checkpoint may take before the kubelet kills the container."""

    health_file: str = ""
    """Keep this file present while the loop makes progress; empty disables."""

    file_poll_interval_s: Annotated[float, Field(gt=0)] = 0.05
    """How often the local file membership source looks at the world file."""

    join_token: SecretStr = SecretStr("")
    """The job's join token (read from the file named by ``RINGWRIGHT_JOIN_TOKEN_FILE``):
    it tags every value in the generation stores, so a process without it cannot claim a
    rank. Empty only in runs that launch no untrusted neighbours."""

    connect_retry_s: Annotated[float, Field(gt=0)] = 1.0
    """Attempt length when connecting to this generation's store; between attempts the
    runtime checks whether a newer world has replaced the one it is joining."""

    stats_interval_s: Annotated[float, Field(gt=0)] = 30.0
    """How often a pod sends its measurements (step times, time per phase, checkpoint
    interval) beside its reports, once past shorter gaps at start-up; each one wakes the
    operator's round for the job."""

    @model_validator(mode="after")
    def _detection_before_timeout(self) -> RuntimeSettings:
        if self.failure_detect_s >= self.collective_timeout_s:
            raise ValueError(
                f"failure_detect_s ({self.failure_detect_s}) must be shorter than "
                f"collective_timeout_s ({self.collective_timeout_s}): heartbeats find the "
                "dead, the collective timeout is only a last resort")
        return self

    @property
    def heartbeat_interval_s(self) -> float:
        """How often a member heartbeats and looks at its peers' heartbeats."""
        return min(max(self.failure_detect_s / 6, 0.05), 1.0)

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **overrides: Any) -> RuntimeSettings:
        """Settings from the environment, with explicit ``overrides`` taking precedence."""
        names = {
            "failure_detect_s": SettingsEnv.FAILURE_DETECT,
            "collective_timeout_s": SettingsEnv.COLLECTIVE_TIMEOUT,
            "group_init_timeout_s": SettingsEnv.GROUP_INIT_TIMEOUT,
            "fence_timeout_s": SettingsEnv.FENCE_TIMEOUT,
            "rendezvous_timeout_s": SettingsEnv.RENDEZVOUS_TIMEOUT,
            "world_wait_timeout_s": SettingsEnv.WORLD_WAIT_TIMEOUT,
            "stall_timeout_s": SettingsEnv.STALL_TIMEOUT,
            "readiness_port": SettingsEnv.READINESS_PORT,
            "readiness_address": Env.POD_IP,
            "metrics_port": Env.METRICS_PORT,
            "metrics_address": Env.POD_IP,
            "health_file": Env.HEALTH_FILE,
            "termination_grace_s": Env.TERMINATION_GRACE,
            "stats_interval_s": SettingsEnv.STATS_INTERVAL,
        }
        values: dict[str, Any] = {
            field: environ[var] for field, var in names.items() if environ.get(var, "") != ""
        }
        token_file = environ.get(Env.JOIN_TOKEN_FILE, "")
        if token_file:
            try:
                values["join_token"] = Path(token_file).read_text().strip()
            except OSError as err:
                raise ValueError(f"cannot read the join token at {token_file}: {err}") from err
        values.update(overrides)
        try:
            return cls.model_validate(values)
        except ValidationError as err:
            raise ValueError(f"invalid ringwright runtime settings: {err}") from err
