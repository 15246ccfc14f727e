"""Persistent stragglers: members timed by the runtime's own timekeeping (fake clocks),
judged by the planner round after round (a fake operator clock).

A ring moves in lockstep: each step lasts as long as the slowest member's compute, and
the others wait that difference in the gradient all-reduce.
"""

from __future__ import annotations

from typing import Any

import pytest

from ringwright.objects import Obj
from ringwright.operator.api.models import AvoidedNode, SlowMember
from ringwright.operator.api.schedulingpolicy import SchedulingPolicySpec
from ringwright.operator.plan.health.stragglers import avoiding, judge, still_avoided
from ringwright.operator.plan.reconcile import Observed, plan
from ringwright.runtime.timekeeping import TimeKeeper
from ringwright.stragglers import faster_without, slowness
from ringwright.world import MemberStats
from tests.unit.operator.test_reconcile import NODES, NOW, SETTINGS, FakePlacer, job, pod, world_of

WINDOW = 120
POLICY = SchedulingPolicySpec.model_validate(
    {"stragglers": {"factor": 1.5, "windowSeconds": WINDOW, "avoidSeconds": 600}})
COMPUTE = 0.5
"""Seconds of compute per step of a healthy member."""
ROUND_EVERY = 10.0
"""Seconds between planner rounds (the stats interval)."""


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Ring:
    """Four members training in lockstep, each timed by a TimeKeeper on one clock."""

    def __init__(self, size: int = 4) -> None:
        self.clock = Clock(0.0)
        self.keepers = [TimeKeeper(clock=self.clock, wall_clock=self.clock)
                        for _ in range(size)]
        for k in self.keepers:
            k.world_ready(1, 0)
        self.step = 0

    def run(self, seconds: float, slow: dict[int, float] | None = None,
            pause: dict[int, float] | None = None) -> None:
        """Train for ``seconds``: member i computes ``slow[i]`` times longer, and pauses
        ``pause[i]`` seconds once in the first step."""
        end = self.clock.now + seconds
        first = True
        while self.clock.now < end:
            computes = [COMPUTE * (slow or {}).get(i, 1.0) for i in range(len(self.keepers))]
            if first:
                computes = [c + (pause or {}).get(i, 0.0) for i, c in enumerate(computes)]
                first = False
            longest = max(computes)
            for keeper, compute in zip(self.keepers, computes, strict=True):
                keeper.waited(longest - compute)
            self.clock.now += longest
            self.step += 1
            for keeper in self.keepers:
                keeper.stepped(self.step)

    def stats(self) -> dict[str, MemberStats]:
        return {f"tj-worker-{i}": k.stats() for i, k in enumerate(self.keepers)}


PODS = [pod(i, node=f"rack-{i // 2}-node-{i % 2}") for i in range(4)]


def rounds(ring: Ring, minutes: float, *, slow: dict[int, float] | None = None,
           pause: dict[int, float] | None = None, placer: FakePlacer | None = None,
           minimum: int = 2) -> tuple[list[Any], Obj]:
    """Plan a round every ROUND_EVERY seconds while the ring trains; the status carries
    over from round to round. The pause (if any) happens in the first interval."""
    status: Obj = {"phase": "Running", "world": {"generation": 1, "size": 4}}
    plans = []
    pods = list(PODS)
    for n in range(int(minutes * 60 / ROUND_EVERY)):
        ring.run(ROUND_EVERY, slow, pause if n == 0 else None)
        now = NOW + n * ROUND_EVERY
        observed = Observed(job=job(minimum=minimum, status=status), pods=pods,
                            world=world_of(range(4)), reports={}, policy=POLICY,
                            inventory=NODES, stats=ring.stats())
        result = plan(observed, SETTINGS, now, placer or FakePlacer())
        plans.append(result)
        status = result.status
        # The apply layer marks them; the next round sees the annotation.
        pods = [pod(i, node=f"rack-{i // 2}-node-{i % 2}", leaving=now)
                if p["metadata"]["name"] in result.mark_leaving else p
                for i, p in enumerate(pods)]
    return plans, status


def leaving(plans: list[Any]) -> list[str]:
    return [name for p in plans for name in p.mark_leaving]


def test_a_member_slow_2x_for_good_is_flagged_after_the_window_and_replaced() -> None:
    plans, status = rounds(Ring(), minutes=5, slow={3: 2.0})
    assert leaving(plans) == ["tj-worker-3"], "replaced once, not before the window"
    flagged = next(i for i, p in enumerate(plans) if p.mark_leaving)
    assert flagged * ROUND_EVERY >= WINDOW
    assert not any(p.mark_leaving for p in plans[:flagged])
    events = [e for p in plans for e in p.events if e.reason.startswith("Straggler")]
    assert [e.reason for e in events] == ["StragglerReplaced"]
    assert "tj-worker-3 on node rack-1-node-1" in events[0].message
    assert "2.00x slower" in events[0].message
    condition = next(c for c in plans[flagged].status["conditions"] if c["type"] == "Straggler")
    assert (condition["status"], condition["reason"]) == ("True", "StragglerReplaced")
    assert [a["node"] for a in status["avoidedNodes"]] == ["rack-1-node-1"]
    condition = next(c for c in status["conditions"] if c["type"] == "Straggler")
    assert (condition["status"], condition["reason"]) == ("False", "NoStragglers"), \
        "once the straggler left, the members keep pace"


def test_the_replacement_is_placed_off_the_avoided_node() -> None:
    _, status = rounds(Ring(), minutes=3, slow={3: 2.0})
    pods = [*PODS[:3], pod(3, node="rack-1-node-1", leaving=NOW)]
    observed = Observed(job=job(status=status), pods=pods, world=world_of(range(3), 2),
                        reports={}, policy=POLICY, inventory=NODES)
    result = plan(observed, SETTINGS, NOW + 200, FakePlacer())
    [created] = result.create
    terms = created["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchFields": [
        {"key": "metadata.name", "operator": "NotIn", "values": ["rack-1-node-1"]}]}]


def test_a_one_off_30s_pause_costs_nothing() -> None:
    plans, status = rounds(Ring(), minutes=10, pause={2: 30.0})
    assert leaving(plans) == []
    assert not [e for p in plans for e in p.events if e.reason.startswith("Straggler")]
    assert status.get("slowMembers", []) == [] and status.get("avoidedNodes", []) == []


def test_slow_for_less_than_the_window_costs_nothing() -> None:
    ring = Ring()
    plans, _ = rounds(ring, minutes=1.5, slow={1: 2.0})
    more, status = rounds(ring, minutes=5)
    assert leaving(plans + more) == []
    assert status.get("slowMembers", []) == []


def test_without_a_spare_the_straggler_is_dropped_when_the_ring_is_faster_without() -> None:
    plans, _ = rounds(Ring(), minutes=5, slow={0: 2.0}, placer=FakePlacer(room=0))
    assert leaving(plans) == ["tj-worker-0"]
    reasons = [e.reason for p in plans for e in p.events if e.reason.startswith("Straggler")]
    assert reasons == ["StragglerDropped"]


def test_without_a_spare_a_job_at_its_minimum_keeps_the_straggler() -> None:
    plans, status = rounds(Ring(), minutes=5, slow={0: 2.0}, placer=FakePlacer(room=0),
                           minimum=4)
    assert leaving(plans) == []
    condition = next(c for c in status["conditions"] if c["type"] == "Straggler")
    assert (condition["status"], condition["reason"]) == ("True", "StragglerKept")
    reasons = [e.reason for p in plans for e in p.events if e.reason.startswith("Straggler")]
    assert reasons == ["StragglerKept"], "said once, not every round"
    first = next(p.status["avoidedNodes"] for p in plans if p.status.get("avoidedNodes"))
    assert status["avoidedNodes"] == first, "the record's expiry does not move every round"


def test_a_disabled_policy_flags_nobody() -> None:
    ring = Ring()
    ring.run(600, slow={3: 3.0})
    policy = SchedulingPolicySpec.model_validate({"stragglers": {"enabled": False}})
    status: Obj = {"slowMembers": [{"pod": "tj-worker-3", "since": NOW - 9999, "ratio": 3.0}]}
    observed = Observed(job=job(status=status), pods=PODS, world=world_of(range(4)),
                        reports={}, policy=policy, inventory=NODES, stats=ring.stats())
    result = plan(observed, SETTINGS, NOW, FakePlacer())
    assert result.mark_leaving == [] and result.status.get("slowMembers", []) == []


def test_slowness_compares_compute_time_with_the_peers_median() -> None:
    ring = Ring()
    ring.run(60, slow={3: 2.0})
    ratios = slowness(ring.stats(), world_of(range(4)))
    assert ratios["tj-worker-3"] == pytest.approx(2.0)
    assert ratios["tj-worker-0"] == pytest.approx(1.0)
    assert slowness(ring.stats(), world_of(range(4), generation=2)) == {}, \
        "stats of another world are not compared"


def test_judge_keeps_the_first_time_a_member_was_seen_slow() -> None:
    before = [SlowMember(pod="a", since=100.0, ratio=2.0)]
    verdict = judge({"a": 2.0, "b": 1.0}, {"a": "n1"}, before, factor=1.5, window_s=50,
                    now=140.0)
    assert [m.since for m in verdict.watching] == [100.0] and verdict.stragglers == ()
    verdict = judge({"a": 2.0}, {"a": "n1"}, before, factor=1.5, window_s=50, now=150.0)
    assert [(m.pod, m.node) for m in verdict.stragglers] == [("a", "n1")]


@pytest.mark.parametrize(("ratio", "size", "faster"),
                         [(2.0, 4, True), (1.2, 4, False), (2.0, 2, False), (2.5, 2, True)])
def test_faster_without(ratio: float, size: int, faster: bool) -> None:
    assert faster_without(ratio, size) is faster


def test_avoided_nodes_expire_and_fragments_keep_their_own_terms() -> None:
    records = [AvoidedNode(node="a", until="1970-01-01T00:01:40Z"),
               AvoidedNode(node="b", until="1970-01-01T00:03:20Z")]
    assert [a.node for a in still_avoided(records, 150.0)] == ["b"]
    fragment = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "In",
                                                     "values": ["H100"]}]}]}}}}
    away = avoiding(fragment, ["b"])
    [term] = away["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert term["matchExpressions"][0]["key"] == "gpu"
    assert term["matchFields"] == [{"key": "metadata.name", "operator": "NotIn",
                                    "values": ["b"]}]
    assert avoiding(fragment, []) is fragment
