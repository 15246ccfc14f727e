"""Fixtures for tests on an emulated datacenter network (network namespaces; root)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from ringwright.devcluster.netemu import EmulatedNetwork, NetworkSpec
from tests.conftest import IN_CI

NetworkFactory = Callable[..., EmulatedNetwork]
"""Takes :class:`EmulatedNetwork`'s arguments."""


def _cannot_emulate_reason() -> str | None:
    if os.geteuid() != 0:
        return "the emulated network needs root (network namespaces, tc)"
    if not os.path.exists("/usr/sbin/ip") and not os.path.exists("/sbin/ip"):
        return "the emulated network needs iproute2 (ip, tc)"
    return None


@pytest.fixture()
def can_emulate() -> None:
    """This machine can build emulated networks: a skip locally when not, a failure in CI."""
    reason = _cannot_emulate_reason()
    if reason:
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture()
def emulated_network(can_emulate: None) -> Iterator[NetworkFactory]:
    """Builds emulated networks for one test and removes all of them afterwards,
    whatever the test did."""
    built: list[EmulatedNetwork] = []

    def build(spec: NetworkSpec, netem: bool | None = None) -> EmulatedNetwork:
        net = EmulatedNetwork(spec, netem)
        built.append(net.__enter__())
        return net

    try:
        yield build
    finally:
        for net in built:
            net.close()
