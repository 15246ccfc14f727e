"""An emulated datacenter network on one Linux machine: racks, a spine, rate limits.

Every worker gets its own network namespace with one interface, ``eth0``; every rack
is a namespace holding a bridge (its top-of-rack switch) with one port per worker
and an uplink to the spine, a namespace with one more bridge. Token-bucket filters
(``tc tbf``) set each worker's link rate in both directions and each rack's uplink
rate, which is the rack's total worker rate divided by the oversubscription ratio.
Every uplink can add a one-way delay (a message between racks crosses two uplinks):
with the kernel's ``sch_netem`` where it has one, else with a user-space delay line
(:mod:`ringwright.devcluster.delayline`): the uplink's veth pair becomes two TAP
devices, one in the rack's namespace and one in the spine's, and a relay process
between them holds every frame for the delay. Links use a large MTU so the relay
moves few frames.

Nothing is created in the caller's namespace: links are made directly between the
new namespaces, so interface names never collide and deleting the namespaces
removes everything. Namespace names carry the creating process's id, so
:func:`sweep_stale` can remove what a killed run left behind.

:func:`plan_network` is pure (``ip``/``tc`` command lines and the relays to start);
:class:`EmulatedNetwork` applies a plan, starts the relays and always stops them and
tears everything down. Needs root.
"""

from __future__ import annotations

import contextlib
import gzip
import itertools
import os
import select
import subprocess
import sys
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
    """One-way delay added on every uplink, so twice this between two racks."""
    mtu: int = 9000
    """MTU of every link (jumbo frames: fewer frames for a delay-line relay to move)."""

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
class Relay:
    """A delay line between two TAP devices, each in its own namespace."""

    delay_ms: float
    ends: tuple[tuple[str, str], tuple[str, str]]
    """(namespace, device) of each end."""

    def argv(self) -> list[str]:
        """The relay's command line, started inside the first end's namespace."""
        (ns_a, dev_a), (ns_b, dev_b) = self.ends
        return ["ip", "netns", "exec", ns_a, sys.executable, "-m",
                "ringwright.devcluster.delayline", f"{self.delay_ms:g}",
                ns_a, dev_a, ns_b, dev_b]


@dataclass(frozen=True)
class NetworkPlan:
    """What to create: namespaces, then commands, in order, then the relays."""

    namespaces: tuple[str, ...]
    commands: tuple[tuple[str, ...], ...]
    hosts: tuple[Host, ...]
    relays: tuple[Relay, ...] = ()


def netem_available() -> bool:
    """Whether this kernel can add delay (``sch_netem`` built in or loadable)."""
    try:
        with open("/proc/config.gz", "rb") as f:
            config = gzip.decompress(f.read()).decode()
        return "CONFIG_NET_SCH_NETEM=y" in config or "CONFIG_NET_SCH_NETEM=m" in config
    except OSError:
        return os.path.exists("/sys/module/sch_netem")


def _rate(dev: str, ns: str, mbit: float, delay_ms: float, mtu: int
          ) -> list[tuple[str, ...]]:
    """Shape ``dev``'s egress to ``mbit``, with a netem delay below it when asked."""
    # At least 4 ms worth of bytes, and two frames: tbf drops a frame larger than its burst.
    burst = max(16_000, 2 * (mtu + 64), int(mbit * 1e6 / 8 / 250))
    cmds: list[tuple[str, ...]] = [(
        "tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
        "rate", f"{mbit:.3f}mbit", "burst", str(burst), "latency", "100ms")]
    if delay_ms > 0:
        cmds.append(("tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1",
                     "handle", "10:", "netem", "delay", f"{delay_ms:g}ms"))
    return cmds


def plan_network(spec: NetworkSpec, tag: str, *, netem: bool) -> NetworkPlan:
    """The namespaces, ``ip``/``tc`` commands and relays that build ``spec``; names
    start with ``PREFIX + tag``. ``netem``: whether the kernel can delay (else a
    delayed uplink is a relay between two TAP devices)."""
    base = f"{PREFIX}{tag}"
    spine = f"{base}-spine"
    namespaces = [spine]
    cmds: list[tuple[str, ...]] = []
    relays = []
    mtu = str(spec.mtu)
    relayed = spec.spine_delay_ms > 0 and not netem
    qdisc_delay = 0.0 if relayed else spec.spine_delay_ms

    def bridge(ns: str) -> None:
        cmds.extend([("ip", "-n", ns, "link", "set", "lo", "up"),
                     ("ip", "-n", ns, "link", "add", "br0", "mtu", mtu, "type", "bridge"),
                     ("ip", "-n", ns, "link", "set", "br0", "up")])

    bridge(spine)
    hosts = []
    index = 0
    for r, count in enumerate(spec.racks):
        tor = f"{base}-rack{r}"
        namespaces.append(tor)
        bridge(tor)
        if relayed:
            cmds.extend([("ip", "-n", tor, "tuntap", "add", "dev", "uplink", "mode", "tap"),
                         ("ip", "-n", spine, "tuntap", "add", "dev", f"r{r}", "mode", "tap")])
            relays.append(Relay(spec.spine_delay_ms, ((tor, "uplink"), (spine, f"r{r}"))))
        else:
            cmds.append(("ip", "-n", tor, "link", "add", "uplink", "type", "veth", "peer",
                         "name", f"r{r}", "netns", spine))
        cmds.extend([
            ("ip", "-n", tor, "link", "set", "uplink", "master", "br0", "mtu", mtu, "up"),
            ("ip", "-n", spine, "link", "set", f"r{r}", "master", "br0", "mtu", mtu, "up"),
            *_rate("uplink", tor, spec.uplink_mbit(r), qdisc_delay, spec.mtu),
            *_rate(f"r{r}", spine, spec.uplink_mbit(r), qdisc_delay, spec.mtu),
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
                ("ip", "-n", ns, "link", "set", "eth0", "mtu", mtu, "up"),
                ("ip", "-n", tor, "link", "set", f"p{j}", "master", "br0", "mtu", mtu, "up"),
                *_rate("eth0", ns, spec.worker_mbit, 0.0, spec.mtu),
                *_rate(f"p{j}", tor, spec.worker_mbit, 0.0, spec.mtu),
            ])
            hosts.append(host)
            index += 1
    return NetworkPlan(tuple(namespaces), tuple(cmds), tuple(hosts), tuple(relays))


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


def _start_relay(relay: Relay, timeout_s: float = 60.0) -> subprocess.Popen[bytes]:
    """Start ``relay`` and wait until it holds both devices."""
    proc = subprocess.Popen(relay.argv(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if ready and proc.stdout.readline().strip() == b"ready":
        return proc
    proc.kill()
    _, err = proc.communicate()
    raise RuntimeError(f"delay line {relay.ends} did not start: {err.decode()[-2000:]}")


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a live process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class EmulatedNetwork:
    """A live emulated network: built on entry (after sweeping stale ones), removed on
    exit, also when building it failed half-way. ``netem`` says whether to delay with
    the kernel's qdisc; by default, whenever the kernel has it."""

    def __init__(self, spec: NetworkSpec, netem: bool | None = None) -> None:
        self.spec = spec
        self.tag = f"{os.getpid()}x{next(_counter)}"
        self.plan = plan_network(spec, self.tag,
                                 netem=netem_available() if netem is None else netem)
        self._created: list[str] = []
        self._relays: list[subprocess.Popen[bytes]] = []

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
            for relay in self.plan.relays:
                self._relays.append(_start_relay(relay))
        except BaseException:
            self.close()
            raise
        return self

    @property
    def relay_pids(self) -> list[int]:
        """Process ids of the running delay-line relays."""
        return [proc.pid for proc in self._relays]

    def relay_cpu_seconds(self) -> float:
        """CPU time the delay-line relays have used so far, all together."""
        return sum(_cpu_seconds(pid) for pid in self.relay_pids)

    def close(self) -> None:
        """Stop the relays, then delete every namespace of this network (idempotent).

        A relay holds its devices' namespaces alive, so it goes first."""
        while self._relays:
            proc = self._relays.pop()
            proc.kill()
            proc.communicate()
        while self._created:
            delete_namespace(self._created.pop())

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
