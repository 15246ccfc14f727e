"""An emulated datacenter network on one Linux machine: racks, a spine, rate limits.

Every worker gets its own network namespace with one interface, ``eth0``; every rack
is a namespace holding a bridge (its top-of-rack switch) with one port per worker
and an uplink to the spine, a namespace with one more bridge. Token-bucket filters
(``tc tbf``) set each worker's link rate in both directions and each rack's uplink
rate, which is the rack's total worker rate divided by the oversubscription ratio.
When the kernel has ``sch_netem``, the uplinks also add a one-way delay.

Nothing is created in the caller's namespace: links are made directly between the
new namespaces, so interface names never collide and deleting the namespaces
removes everything. Namespace names carry the creating process's id, so
:func:`sweep_stale` can remove what a killed run left behind.

:func:`plan_network` is pure (a list of ``ip``/``tc`` command lines);
:class:`EmulatedNetwork` applies a plan and always tears it down. Needs root.
"""

from __future__ import annotations

import contextlib
import gzip
import itertools
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

PREFIX = "rwnet-"
"""Every namespace this module creates starts with this."""

SUBNET = "10.213"
"""Workers get 10.213.<rack>.<10 + index>/16; it exists only inside our namespaces."""

_counter = itertools.count()


@dataclass(frozen=True)
class NetworkSpec:
    """The shape and speeds of an emulated network."""

    racks: tuple[int, ...]
    """Workers per rack."""
    worker_mbit: float = 40.0
    """Rate of each worker's link to its rack switch, in each direction."""
    oversubscription: float = 4.0
    """A rack's total worker rate over its uplink rate (4.0: a 4:1 spine)."""
    spine_delay_ms: float = 0.0
    """One-way delay added on every uplink; needs the kernel's netem qdisc."""

    def uplink_mbit(self, rack: int) -> float:
        """The uplink rate of ``rack``."""
        return self.racks[rack] * self.worker_mbit / self.oversubscription


@dataclass(frozen=True)
class Host:
    """A worker of the emulated network."""

    index: int
    rack: int
    namespace: str
    ip: str


@dataclass(frozen=True)
class NetworkPlan:
    """What to create: namespaces, then commands, in order."""

    namespaces: tuple[str, ...]
    commands: tuple[tuple[str, ...], ...]
    hosts: tuple[Host, ...]


def netem_available() -> bool:
    """Whether this kernel can add delay (``sch_netem`` built in or loadable)."""
    try:
        with open("/proc/config.gz", "rb") as f:
            config = gzip.decompress(f.read()).decode()
        return "CONFIG_NET_SCH_NETEM=y" in config or "CONFIG_NET_SCH_NETEM=m" in config
    except OSError:
        return os.path.exists("/sys/module/sch_netem")


def _rate(dev: str, ns: str, mbit: float, delay_ms: float) -> list[tuple[str, ...]]:
    """Shape ``dev``'s egress to ``mbit``, with a netem delay below it when asked."""
    burst = max(16_000, int(mbit * 1e6 / 8 / 250))  # at least 4 ms worth of bytes
    cmds: list[tuple[str, ...]] = [(
        "tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
        "rate", f"{mbit:.3f}mbit", "burst", str(burst), "latency", "100ms")]
    if delay_ms > 0:
        cmds.append(("tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1",
                     "handle", "10:", "netem", "delay", f"{delay_ms}ms"))
    return cmds


def plan_network(spec: NetworkSpec, tag: str) -> NetworkPlan:
    """The namespaces and ``ip``/``tc`` commands that build ``spec``; names start with
    ``PREFIX + tag``."""
    base = f"{PREFIX}{tag}"
    spine = f"{base}-spine"
    namespaces = [spine]
    cmds: list[tuple[str, ...]] = []

    def bridge(ns: str) -> None:
        cmds.extend([("ip", "-n", ns, "link", "set", "lo", "up"),
                     ("ip", "-n", ns, "link", "add", "br0", "type", "bridge"),
                     ("ip", "-n", ns, "link", "set", "br0", "up")])

    bridge(spine)
    hosts = []
    index = 0
    for r, count in enumerate(spec.racks):
        tor = f"{base}-rack{r}"
        namespaces.append(tor)
        bridge(tor)
        cmds.extend([
            ("ip", "-n", tor, "link", "add", "uplink", "type", "veth", "peer", "name", f"r{r}",
             "netns", spine),
            ("ip", "-n", tor, "link", "set", "uplink", "master", "br0", "up"),
            ("ip", "-n", spine, "link", "set", f"r{r}", "master", "br0", "up"),
            *_rate("uplink", tor, spec.uplink_mbit(r), spec.spine_delay_ms),
            *_rate(f"r{r}", spine, spec.uplink_mbit(r), spec.spine_delay_ms),
        ])
        for j in range(count):
            ns = f"{base}-w{index}"
            host = Host(index=index, rack=r, namespace=ns, ip=f"{SUBNET}.{r}.{10 + j}")
            namespaces.append(ns)
            cmds.extend([
                ("ip", "-n", ns, "link", "set", "lo", "up"),
                ("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name",
                 f"p{j}", "netns", tor),
                ("ip", "-n", ns, "addr", "add", f"{host.ip}/16", "dev", "eth0"),
                ("ip", "-n", ns, "link", "set", "eth0", "up"),
                ("ip", "-n", tor, "link", "set", f"p{j}", "master", "br0", "up"),
                *_rate("eth0", ns, spec.worker_mbit, 0.0),
                *_rate(f"p{j}", tor, spec.worker_mbit, 0.0),
            ])
            hosts.append(host)
            index += 1
    return NetworkPlan(tuple(namespaces), tuple(cmds), tuple(hosts))


def _run(argv: Sequence[str]) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


def list_namespaces() -> list[str]:
    """Names of the network namespaces this module created (any process)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                         check=False).stdout
    return [line.split()[0] for line in out.splitlines()
            if line.strip() and line.split()[0].startswith(PREFIX)]


def delete_namespace(ns: str) -> None:
    """End the processes inside ``ns`` (all started into it by its creator), then
    delete it; its interfaces go with it."""
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                          check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), 9)
    subprocess.run(["ip", "netns", "delete", ns], capture_output=True, check=False)


def _owner_alive(ns: str) -> bool:
    pid = ns[len(PREFIX):].split("x", 1)[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete the namespaces left by runs whose process is gone; their names."""
    stale = [ns for ns in list_namespaces() if not _owner_alive(ns)]
    for ns in stale:
        delete_namespace(ns)
    return stale


class EmulatedNetwork:
    """A live emulated network: built on entry (after sweeping stale ones), removed on
    exit, also when building it failed half-way."""

    def __init__(self, spec: NetworkSpec) -> None:
        self.spec = spec
        self.tag = f"{os.getpid()}x{next(_counter)}"
        self.plan = plan_network(spec, self.tag)
        self._created: list[str] = []

    @property
    def hosts(self) -> tuple[Host, ...]:
        """The workers, rack by rack."""
        return self.plan.hosts

    def exec_argv(self, host: Host, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", host.namespace, *argv]

    def __enter__(self) -> EmulatedNetwork:
        sweep_stale()
        try:
            for ns in self.plan.namespaces:
                _run(["ip", "netns", "add", ns])
                self._created.append(ns)
            for argv in self.plan.commands:
                _run(argv)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Delete every namespace of this network (idempotent)."""
        while self._created:
            delete_namespace(self._created.pop())

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
