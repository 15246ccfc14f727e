"""Pods in network namespaces of their own, joined by a bridge: a network that a test
can cut without touching anything outside it.

Every pod gets a namespace with one interface (``eth0``, 10.99.0.x/24) whose peer sits
on a bridge in a hub namespace. :meth:`NamespacedPods.cut` takes a pod's bridge port
down: its packets are then dropped silently, with no reset, as when a cable or a
switch fails. Needs root and ``ip`` (iproute2); every namespace is removed on close.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import uuid
from pathlib import Path

SUBNET = "10.99.0"
"""Private to the test's own namespaces: never routed outside them."""

NETNS_ETC = Path("/etc/netns")
"""``ip netns exec NS`` mounts the files of ``/etc/netns/NS/`` over ``/etc``."""


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's ip"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class NamespacedPods:
    """A :class:`~ringwright.runtime.local.launcher.PodNetwork` of network namespaces."""

    def __init__(self) -> None:
        self._tag = uuid.uuid4().hex[:6]
        self.hub = f"rw-{self._tag}-hub"
        self._namespaces: list[str] = []
        self._add_namespace(self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")

    def namespace(self, index: int) -> str:
        """The namespace of pod ``index``."""
        return f"rw-{self._tag}-p{index}"

    def attach(self, index: int) -> tuple[str, list[str], dict[str, str]]:
        """Create pod ``index``'s namespace (once) and say how to run a process in it."""
        ns, port = self.namespace(index), f"p{index}"
        address = f"{SUBNET}.{10 + index}"
        if ns not in self._namespaces:
            self._add_namespace(ns)
            _ip("-n", self.hub, "link", "add", port, "type", "veth",
                "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.hub, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            # As the kubelet writes a pod's /etc/hosts: the host name resolves to the
            # pod's address. Horovod's gloo binds one of its devices by host name;
            # the machine's own entry (127.x) would make peers connect to themselves.
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / ns / "hosts").write_text(
                f"127.0.0.1 localhost\n{address} {socket.gethostname()}\n")
        # Gloo (torch and Horovod) must talk over the pod's interface, not loopback.
        env = {"GLOO_SOCKET_IFNAME": "eth0", "HOROVOD_GLOO_IFACE": "eth0"}
        return address, ["ip", "netns", "exec", ns], env

    def cut(self, index: int) -> None:
        """Cut pod ``index`` off from every other pod (silently dropped packets)."""
        _ip("-n", self.hub, "link", "set", f"p{index}", "down")

    def close(self) -> None:
        """Remove every namespace (and with them the interfaces)."""
        for ns in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        self._namespaces = []

    def _add_namespace(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._namespaces.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")
