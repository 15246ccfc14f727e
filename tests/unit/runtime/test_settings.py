"""Runtime settings: read from the environment, validated with a clear message."""

from __future__ import annotations

import pytest

from ringwright.runtime.settings import RuntimeSettings, SettingsEnv
from ringwright.world import Env


def test_defaults_fail_fast_but_wait_patiently_for_peers() -> None:
    s = RuntimeSettings.from_env({})
    assert s.collective_timeout_s < s.rendezvous_timeout_s < s.world_wait_timeout_s
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
    ],
)
def test_bad_values_are_refused_with_the_setting_named(env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="invalid ringwright runtime settings"):
        RuntimeSettings.from_env(env)
