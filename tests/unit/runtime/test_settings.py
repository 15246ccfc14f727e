"""Runtime settings: read from the environment, validated with a clear message."""

from __future__ import annotations

import pytest

from ringwright.runtime.settings import RuntimeSettings, SettingsEnv
from ringwright.world import Env


def test_defaults_detect_death_fast_but_wait_patiently_for_slow_peers() -> None:
    s = RuntimeSettings.from_env({})
    assert s.heartbeat_interval_s < s.failure_detect_s == 3.0
    assert s.failure_detect_s < s.group_init_timeout_s < s.rendezvous_timeout_s
    assert s.stall_timeout_s < s.collective_timeout_s
    assert (s.readiness_port, s.health_file) == (0, "")


def test_environment_and_overrides() -> None:
    env = {
        SettingsEnv.COLLECTIVE_TIMEOUT: "3.5",
        SettingsEnv.READINESS_PORT: "8080",
        SettingsEnv.STALL_TIMEOUT: "",
        Env.HEALTH_FILE: "/run/ready",
    }
    s = RuntimeSettings.from_env(env, stall_timeout_s=60)
    assert (s.collective_timeout_s, s.readiness_port, s.health_file, s.stall_timeout_s) == (
        3.5, 8080, "/run/ready", 60)


@pytest.mark.parametrize(
    "env",
    [
        {SettingsEnv.COLLECTIVE_TIMEOUT: "0"},
        {SettingsEnv.COLLECTIVE_TIMEOUT: "soon"},
        {SettingsEnv.STALL_TIMEOUT: "-1"},
        {SettingsEnv.READINESS_PORT: "70000"},
        {SettingsEnv.FAILURE_DETECT: "0"},
        {SettingsEnv.FAILURE_DETECT: "20", SettingsEnv.COLLECTIVE_TIMEOUT: "10"},
    ],
)
def test_bad_values_are_refused_with_the_setting_named(env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="invalid ringwright runtime settings"):
        RuntimeSettings.from_env(env)
