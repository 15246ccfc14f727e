"""The emulated network: racks are measurably faster inside than across, the spine
adds its delay only between racks, and nothing it creates (namespaces, delay-line
relays) outlives the network, also when a run fails or is killed."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

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
from ringwright.devcluster.netprobe import AlphaBeta, fit_alpha_beta
from tests.network.conftest import NetworkFactory

pytestmark = pytest.mark.timeout(300)

PROBE = [sys.executable, "-m", "ringwright.devcluster.netprobe"]


def round_times(net: EmulatedNetwork, src: Host, dst: Host, port: int, repeats: int,
                *sizes: int) -> list[tuple[int, float]]:
    server = subprocess.Popen(net.exec_argv(dst, [*PROBE, "serve", str(port)]))
    try:
        out = subprocess.run(
            net.exec_argv(src, [*PROBE, "send", dst.ip, str(port), str(repeats),
                                *map(str, sizes)]),
            capture_output=True, text=True, check=True, timeout=120)
        server.wait(timeout=30)
    finally:
        server.kill()
    return [(size, t) for size, t in json.loads(out.stdout)]


def probe(net: EmulatedNetwork, src: Host, dst: Host, port: int) -> AlphaBeta:
    return fit_alpha_beta(round_times(net, src, dst, port, 3, 1, 65536, 500000, 1000000))


def test_bandwidth_inside_a_rack_exceeds_bandwidth_across_racks(
        emulated_network: NetworkFactory) -> None:
    # 2 workers per rack at 8:1: the uplink gets a quarter of one worker's link.
    net = emulated_network(NetworkSpec(racks=(2, 2), worker_mbit=80, oversubscription=8))
    a, b, c, _ = net.hosts
    assert (a.rack, b.rack, c.rack) == (0, 0, 1)

    inside = probe(net, a, b, 5101)
    across = probe(net, a, c, 5102)

    # Configured 80 vs 20 Mbit/s; the margin absorbs a loaded machine.
    assert across.mbit_per_s < 0.6 * inside.mbit_per_s, (inside, across)


def test_the_delay_line_delays_between_racks_only(emulated_network: NetworkFactory) -> None:
    # The user-space delay line, also where the kernel has netem.
    delay_s = 0.010
    net = emulated_network(NetworkSpec(racks=(2, 2), spine_delay_ms=delay_s * 1000),
                           netem=False)
    a, b, c, _ = net.hosts

    [(_, inside)] = round_times(net, a, b, 5103, 9, 1)
    [(_, across)] = round_times(net, a, c, 5104, 9, 1)

    # Between racks a byte and its answer cross two delayed uplinks each way: 4 delays.
    assert across > 3.5 * delay_s + inside, (inside, across)
    assert inside < 2 * delay_s, (inside, across)


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
from ringwright.devcluster.netemu import EmulatedNetwork, NetworkSpec
net = EmulatedNetwork(NetworkSpec(racks=(1, 1), spine_delay_ms=1), netem=False).__enter__()
print(net.tag, *net.relay_pids, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.usefixtures("can_emulate")
def test_a_killed_owner_leaves_no_relay_and_its_namespaces_are_swept() -> None:
    out = subprocess.run([sys.executable, "-c", BUILD_AND_DIE], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == -9, out.stderr
    tag, *relays = out.stdout.split()
    assert len(relays) == 2
    try:
        # The relays die with their owner, before anyone sweeps.
        for pid in map(int, relays):
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).wait(timeout=30)
        assert [n for n in sweep_stale() if tag in n] != []
        assert [n for n in list_namespaces() if tag in n] == []
    finally:
        for ns in list_namespaces():
            if tag in ns:
                delete_namespace(ns)


@pytest.mark.usefixtures("can_emulate")
def test_sweep_removes_namespaces_of_dead_runs() -> None:
    # A namespace named as if created by a process that has exited.
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"{PREFIX}{dead.pid}x0-spine"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in sweep_stale()
        assert name not in list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)
