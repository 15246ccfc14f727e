"""The emulated network: every link carries the rate it was configured with, traffic
inside a rack never crosses the rack's uplink while traffic between racks does, the
delay line between racks passes every datagram in order, and nothing it creates
(namespaces, delay-line relays) outlives the network, also when a run fails or is killed.

Nothing here is timed: how fast the links are, and what the spine's delay adds, is
measured by ``tests/bench/bench_network.py`` (its alpha-beta table; ``--delay-line``
for the user-space relay).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from typing import Any

import psutil
import pytest

from ringwright.devcluster.netemu import (
    PREFIX,
    EmulatedNetwork,
    Host,
    NetworkSpec,
    delete_namespace,
    list_namespaces,
    sweep_stale,
)
from tests.network.conftest import NetworkFactory

pytestmark = pytest.mark.timeout(300)

PROBE = [sys.executable, "-m", "ringwright.devcluster.netprobe"]

UDP_RECEIVER = """
import json, socket, sys
count = int(sys.argv[1])
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    s.bind(("0.0.0.0", 0))
    s.settimeout(60)  # a lost datagram ends the wait: the test then sees it missing
    print(s.getsockname()[1], flush=True)
    got = []
    try:
        while len(got) < count:
            got.append(int(s.recv(64)))
    except TimeoutError:
        pass
print(json.dumps(got), flush=True)
"""

UDP_SENDER = """
import os, socket, sys, time
address, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
# A veth queues a frame on the sending CPU's backlog: a sender that moved between CPUs
# could reorder its own datagrams before they reach the path under test.
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    for i in range(count):
        s.sendto(str(i).encode(), (address, port))
        time.sleep(0.001)  # paced, so no shaper queue fills: loss would be the path's
"""


def exchange(net: EmulatedNetwork, src: Host, dst: Host, size: int) -> None:
    """One message of ``size`` bytes from ``src`` to ``dst`` and its one-byte answer."""
    server = subprocess.Popen(net.exec_argv(dst, [*PROBE, "serve", "5101"]))
    try:
        out = subprocess.run(net.exec_argv(src, [*PROBE, "send", dst.ip, "5101", "1",
                                                 str(size)]),
                             capture_output=True, text=True, check=True, timeout=120)
        server.wait(timeout=30)
    finally:
        server.kill()
    [(sent, _)] = json.loads(out.stdout)
    assert sent == size


def datagrams(net: EmulatedNetwork, src: Host, dst: Host, count: int) -> list[int]:
    """Send ``count`` numbered UDP datagrams from ``src`` to ``dst``; the numbers
    ``dst`` received, in the order it received them."""
    receiver = subprocess.Popen(net.exec_argv(dst, [sys.executable, "-c", UDP_RECEIVER,
                                                    str(count)]),
                                stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout is not None
        port = int(receiver.stdout.readline())
        subprocess.run(net.exec_argv(src, [sys.executable, "-c", UDP_SENDER, dst.ip,
                                           str(port), str(count)]),
                       check=True, timeout=120)
        out, _ = receiver.communicate(timeout=120)
    finally:
        receiver.kill()
    received: list[int] = json.loads(out)
    return received


def qdisc_stats(ns: str, dev: str) -> dict[str, Any]:
    """The root qdisc of ``dev`` in ``ns``, with its counters (``tc -j -s``)."""
    out = subprocess.run(["tc", "-j", "-s", "-n", ns, "qdisc", "show", "dev", dev],
                         capture_output=True, text=True, check=True)
    root: dict[str, Any] = next(q for q in json.loads(out.stdout) if q.get("root"))
    return root


def tx_packets(ns: str, dev: str) -> int:
    """Frames ``dev`` in ``ns`` has sent so far."""
    out = subprocess.run(["ip", "-j", "-s", "-n", ns, "link", "show", "dev", dev],
                         capture_output=True, text=True, check=True)
    return int(json.loads(out.stdout)[0]["stats64"]["tx"]["packets"])


def test_links_carry_their_configured_rates_and_only_traffic_between_racks_uses_uplinks(
        emulated_network: NetworkFactory) -> None:
    # 2 workers per rack at 8:1: the uplink gets a quarter of one worker's link.
    net = emulated_network(NetworkSpec(racks=(2, 2), worker_mbit=80, oversubscription=8))
    a, b, c, _ = net.hosts
    assert (a.rack, b.rack, c.rack) == (0, 0, 1)
    base = f"{PREFIX}{net.tag}"
    rates = {(h.namespace, "eth0"): 80.0 for h in net.hosts}
    for r in (0, 1):
        rates |= {(f"{base}-rack{r}", "p0"): 80.0, (f"{base}-rack{r}", "p1"): 80.0,
                  (f"{base}-rack{r}", "uplink"): 20.0, (f"{base}-spine", f"r{r}"): 20.0}
    for (ns, dev), mbit in rates.items():
        shaper = qdisc_stats(ns, dev)
        assert shaper["kind"] == "tbf", (ns, dev, shaper)
        # tc's JSON gives the rate in bytes per second.
        assert shaper["options"]["rate"] * 8 == mbit * 1e6, (ns, dev, shaper)

    uplink = (f"{base}-rack0", "uplink")

    def uplink_bytes() -> int:
        return int(qdisc_stats(*uplink)["bytes"])

    before = uplink_bytes()
    exchange(net, a, b, 1_000_000)
    inside = uplink_bytes() - before
    exchange(net, a, c, 1_000_000)
    across = uplink_bytes() - before - inside
    # Inside a rack the rack's switch forwards; only flooded broadcasts reach the uplink.
    assert inside < 100_000 <= 1_000_000 <= across, (inside, across)


def test_the_delay_line_carries_traffic_between_racks_in_order_without_loss(
        emulated_network: NetworkFactory) -> None:
    # The user-space delay line, also where the kernel has netem.
    net = emulated_network(NetworkSpec(racks=(2, 2), spine_delay_ms=10), netem=False)
    a, b, c, _ = net.hosts
    base = f"{PREFIX}{net.tag}"
    # One relay per uplink, each running with the configured delay.
    assert len(net.relay_pids) == 2
    for pid in net.relay_pids:
        argv = psutil.Process(pid).cmdline()
        assert "ringwright.devcluster.delayline" in argv and "10" in argv, argv
    uplink = (f"{base}-rack0", "uplink")
    count = 300

    before = tx_packets(*uplink)
    assert datagrams(net, a, b, count) == list(range(count))
    inside = tx_packets(*uplink) - before
    assert datagrams(net, a, c, count) == list(range(count))
    across = tx_packets(*uplink) - before - inside
    # Only traffic between racks crosses the relayed uplink (a few flooded broadcasts aside).
    assert inside < count // 10 and across >= count, (inside, across)


@pytest.mark.usefixtures("can_emulate")
def test_everything_is_removed_also_when_the_body_fails() -> None:
    net = EmulatedNetwork(NetworkSpec(racks=(1, 2), spine_delay_ms=1), netem=False)
    with pytest.raises(RuntimeError, match="boom"), net:
        assert len([n for n in list_namespaces() if net.tag in n]) == 6
        relays = [int(p) for ns in list_namespaces() if net.tag in ns
                  for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                          text=True, check=True).stdout.split()]
        assert len(relays) == 2
        raise RuntimeError("boom")
    assert [n for n in list_namespaces() if net.tag in n] == []
    assert [pid for pid in relays if psutil.pid_exists(pid)] == []


BUILD_AND_DIE = """
import os, signal
from ringwright.devcluster.netemu import EmulatedNetwork, NetworkSpec, list_namespaces
net = EmulatedNetwork(NetworkSpec(racks=(1, 1), spine_delay_ms=1), netem=False).__enter__()
built = sum(net.tag in n for n in list_namespaces())
print(net.tag, built, *net.relay_pids, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.usefixtures("can_emulate")
def test_a_killed_owner_leaves_no_relay_and_its_namespaces_are_swept() -> None:
    out = subprocess.run([sys.executable, "-c", BUILD_AND_DIE], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == -9, out.stderr
    tag, built, *relays = out.stdout.split()
    assert int(built) > 0 and len(relays) == 2
    try:
        # The relays die with their owner, before anyone sweeps.
        for pid in map(int, relays):
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).wait(timeout=30)
        # Swept by this call, or already by a test beside this one (every network built
        # sweeps those of dead owners first): gone either way.
        sweep_stale()
        assert [n for n in list_namespaces() if tag in n] == []
    finally:
        for ns in list_namespaces():
            if tag in ns:
                delete_namespace(ns)


@pytest.mark.usefixtures("can_emulate")
def test_sweep_removes_namespaces_of_dead_runs() -> None:
    # A namespace named as if created by a process that then exits. Its owner lives while
    # it is made: every network built beside this test sweeps dead owners' namespaces,
    # and one deleted half-way through `ip netns add` failed the add.
    owner = subprocess.Popen(["sleep", "600"])
    name = f"{PREFIX}{owner.pid}x0-spine"
    try:
        subprocess.run(["ip", "netns", "add", name], check=True)
        assert name not in sweep_stale(), "a live owner's namespace is kept"
        assert name in list_namespaces()
        owner.kill()
        owner.wait()
        # Swept by this call, or by a test beside this one: gone either way.
        sweep_stale()
        assert name not in list_namespaces()
    finally:
        owner.kill()
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)
