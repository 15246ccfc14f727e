"""The pods of a local job: one process each, at an address of a network.

:class:`Loopback` puts every pod on its own 127.0.0.x address of this machine; a
test may give :class:`~ringwright.runtime.local.launcher.LocalJob` another
:class:`PodNetwork` (network namespaces, say) to cut pods off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .forkserver import Process

FIRST_HOST = 10
"""Pod ``i`` gets 127.0.0.(FIRST_HOST + i); lower addresses are left to the machine."""


@dataclass
class LocalPod:
    """One worker process standing in for a pod."""

    name: str
    ip: str
    index: int
    process: Process
    uid: str = ""
    """This process's incarnation, as a pod's uid: a process started again under the
    pod's name gets a new one, so it never takes its predecessor's entry in a world
    published before its predecessor's exit was seen."""
    rack: str = ""
    leaving: bool = False
    """Dropped by a planned scale-down: its exit is expected and not a failure."""
    evicted_at: float | None = None
    """When it was dropped on its peers' word; killed after the grace period."""
    restarts: int = 0


class PodNetwork(Protocol):
    """Where pod ``index`` lives on the network: its address, a command prefix that
    runs a process there, and environment for it."""

    def attach(self, index: int) -> tuple[str, list[str], dict[str, str]]:
        """(address, command prefix, extra environment) of pod ``index``."""
        ...


class Loopback:
    """Every pod on its own loopback address of this machine."""

    def attach(self, index: int) -> tuple[str, list[str], dict[str, str]]:
        """127.0.0.(FIRST_HOST + index), no prefix."""
        return f"127.0.0.{FIRST_HOST + index}", [], {}

