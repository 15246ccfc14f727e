"""Pure parts of the emulated spine delay: the delay line's queue, and where the
network plan puts the delay (netem qdisc or TAP devices with a relay)."""

from __future__ import annotations

import pytest

from ringwright.devcluster.delayline import DelayLine
from ringwright.devcluster.netemu import NetworkSpec, Relay, plan_network


def test_a_frame_leaves_exactly_the_delay_after_it_came() -> None:
    line = DelayLine(0.005)
    line.push(b"a", now=10.0)
    assert line.next_deadline() == pytest.approx(10.005)
    assert line.pop_due(10.0049) == []
    assert line.pop_due(10.005) == [b"a"]
    assert len(line) == 0
    assert line.next_deadline() is None


def test_frames_leave_in_arrival_order_in_batches_of_those_due() -> None:
    line = DelayLine(0.002)
    for i, t in enumerate([1.0, 1.0, 1.0005, 1.003]):
        line.push(bytes([i]), now=t)
    assert line.pop_due(1.0021) == [b"\x00", b"\x01"]
    assert line.pop_due(1.0026) == [b"\x02"]
    assert line.next_deadline() == pytest.approx(1.005)
    assert line.pop_due(2.0) == [b"\x03"]


def test_order_holds_when_the_clock_steps_back() -> None:
    line = DelayLine(0.001)
    line.push(b"first", now=5.0)
    line.push(b"second", now=4.0)
    assert line.pop_due(4.5) == []
    assert line.pop_due(5.001) == [b"first", b"second"]


def test_zero_delay_passes_frames_at_once_and_negative_is_refused() -> None:
    line = DelayLine(0.0)
    line.push(b"x", now=3.0)
    assert line.pop_due(3.0) == [b"x"]
    with pytest.raises(ValueError, match="negative"):
        DelayLine(-0.001)


SPEC = NetworkSpec(racks=(2, 1), worker_mbit=40, oversubscription=4, spine_delay_ms=3)


def test_without_netem_each_uplink_becomes_two_taps_and_a_relay() -> None:
    plan = plan_network(SPEC, "t", netem=False)
    assert plan.relays == (
        Relay(3.0, (("rwnet-t-rack0", "uplink"), ("rwnet-t-spine", "r0"))),
        Relay(3.0, (("rwnet-t-rack1", "uplink"), ("rwnet-t-spine", "r1"))),
    )
    taps = [c for c in plan.commands if "tuntap" in c]
    assert taps == [
        ("ip", "-n", "rwnet-t-rack0", "tuntap", "add", "dev", "uplink", "mode", "tap"),
        ("ip", "-n", "rwnet-t-spine", "tuntap", "add", "dev", "r0", "mode", "tap"),
        ("ip", "-n", "rwnet-t-rack1", "tuntap", "add", "dev", "uplink", "mode", "tap"),
        ("ip", "-n", "rwnet-t-spine", "tuntap", "add", "dev", "r1", "mode", "tap"),
    ]
    assert not any("veth" in c and "uplink" in c for c in plan.commands)
    assert not any("netem" in c for c in plan.commands)
    # The uplink rate limits stay, on the TAP devices.
    shaped = [(c[2], c[6]) for c in plan.commands if "tbf" in c]
    assert ("rwnet-t-rack0", "uplink") in shaped and ("rwnet-t-spine", "r1") in shaped


def test_with_netem_the_uplinks_stay_veth_and_delay_in_the_qdisc() -> None:
    plan = plan_network(SPEC, "t", netem=True)
    assert plan.relays == ()
    delays = [c for c in plan.commands if "netem" in c]
    assert len(delays) == 4 and all(c[-1] == "3ms" for c in delays)


def test_no_delay_needs_no_relay() -> None:
    plan = plan_network(NetworkSpec(racks=(2, 2)), "t", netem=False)
    assert plan.relays == ()
    assert not any("tuntap" in c or "netem" in c for c in plan.commands)


def test_every_link_gets_the_mtu_and_the_shaper_burst_holds_a_frame() -> None:
    plan = plan_network(NetworkSpec(racks=(2, 2), mtu=16000, worker_mbit=1), "t",
                        netem=False)
    ups = [c for c in plan.commands if c[3:5] == ("link", "set") and "up" in c
           and c[5] != "lo" and c[5] != "br0"]
    assert ups and all(c[c.index("mtu") + 1] == "16000" for c in ups)
    bursts = [int(c[c.index("burst") + 1]) for c in plan.commands if "tbf" in c]
    assert min(bursts) >= 2 * 16000


def test_relay_runs_inside_its_first_namespace() -> None:
    argv = Relay(2.5, (("ns-a", "uplink"), ("ns-b", "r0"))).argv()
    assert argv[:4] == ["ip", "netns", "exec", "ns-a"]
    assert argv[-5:] == ["2.5", "ns-a", "uplink", "ns-b", "r0"]
