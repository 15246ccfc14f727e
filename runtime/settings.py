"""Runtime settings: typed, documented, validated once at start-up."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ringwright.world import Env


class SettingsEnv:
    """Environment variables that tune the runtime (all optional)."""

    COLLECTIVE_TIMEOUT = "RINGWRIGHT_COLLECTIVE_TIMEOUT_SECONDS"
    RENDEZVOUS_TIMEOUT = "RINGWRIGHT_RENDEZVOUS_TIMEOUT_SECONDS"
    WORLD_WAIT_TIMEOUT = "RINGWRIGHT_WORLD_WAIT_TIMEOUT_SECONDS"
    STALL_TIMEOUT = "RINGWRIGHT_STALL_TIMEOUT_SECONDS"
    READINESS_PORT = "RINGWRIGHT_READINESS_PORT"


class RuntimeSettings(BaseModel):
    """How quickly the runtime gives up on peers, worlds and its own training loop."""

    model_config = ConfigDict(frozen=True)

    collective_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    """Limit for one collective (and for forming the group once every member has
    arrived). Short, so a dead or hung peer surfaces in seconds rather than after the
    library default of many minutes."""

    rendezvous_timeout_s: Annotated[float, Field(gt=0)] = 300.0
    """How long members of a new world wait for each other to arrive. It must cover a
    commit interval: on a planned scale-up the newcomers wait until the survivors
    reach their next commit."""

    world_wait_timeout_s: Annotated[float, Field(gt=0)] = 900.0
    """How long to wait for a world that includes this pod, or for a newer world after a
    failure, before giving up with a non-zero exit."""

    stall_timeout_s: Annotated[float, Field(ge=0)] = 300.0
    """Readiness fails when the training loop has not advanced for this long; 0 disables."""

    readiness_port: Annotated[int, Field(ge=0, le=65535)] = 0
    """Serve ``/readyz`` and ``/healthz`` over HTTP on this port; 0 disables."""

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

    connect_retry_s: Annotated[float, Field(gt=0)] = 1.0
    """Attempt length when connecting to this epoch's store; between attempts the
    runtime checks whether a newer world has replaced the one it is joining."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **overrides: Any) -> RuntimeSettings:
        """Settings from the environment, with explicit ``overrides`` taking precedence."""
        names = {
            "collective_timeout_s": SettingsEnv.COLLECTIVE_TIMEOUT,
            "rendezvous_timeout_s": SettingsEnv.RENDEZVOUS_TIMEOUT,
            "world_wait_timeout_s": SettingsEnv.WORLD_WAIT_TIMEOUT,
            "stall_timeout_s": SettingsEnv.STALL_TIMEOUT,
            "readiness_port": SettingsEnv.READINESS_PORT,
            "metrics_port": Env.METRICS_PORT,
            "metrics_address": Env.POD_IP,
            "health_file": Env.HEALTH_FILE,
            "termination_grace_s": Env.TERMINATION_GRACE,
        }
        values: dict[str, Any] = {
            field: environ[var] for field, var in names.items() if environ.get(var, "") != ""
        }
        values.update(overrides)
        try:
            return cls.model_validate(values)
        except ValidationError as err:
            raise ValueError(f"invalid ringwright runtime settings: {err}") from err
