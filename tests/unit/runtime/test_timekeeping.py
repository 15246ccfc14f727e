"""A member's time split into phases, and its step times as medians (fake clocks)."""

from __future__ import annotations

import itertools

import pytest

from ringwright.runtime.timekeeping import STEP_WINDOW, StatsSender, TimeKeeper
from ringwright.world import MemberStats, Phase, parse_stats


class FakeClock:
    def __init__(self, now: float = 50.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def run_steps(keeper: TimeKeeper, clock: FakeClock, first: int, count: int, compute: float,
              wait: float = 0.0) -> None:
    for step in range(first + 1, first + count + 1):
        clock.now += compute
        keeper.waited(wait)
        clock.now += wait
        keeper.stepped(step)
        keeper.stepped(step)  # the commit after it: not a step


def test_phases_add_up_to_the_time_that_passed() -> None:
    clock = FakeClock()
    keeper = TimeKeeper(clock=clock, wall_clock=lambda: 7.0)
    clock.now += 4.0  # start-up to the first world: re-forming
    keeper.syncing()
    clock.now += 1.0
    keeper.world_ready(1, 0)
    run_steps(keeper, clock, 0, 10, compute=0.5)  # 5 s training
    clock.now += 2.0  # blocked on a dead peer, then the failure
    keeper.failed(rolled_back_from=10, rolled_back_to=6)
    keeper.forming()
    clock.now += 3.0
    keeper.world_ready(2, 6)
    run_steps(keeper, clock, 6, 6, compute=0.5)  # 4 steps replayed (2 s), 2 new (1 s)
    stats = keeper.stats()
    assert stats.seconds == {Phase.REFORMING: 7.0, Phase.SYNCING: 1.0, Phase.TRAINING: 6.0,
                             Phase.DETECTING: 2.0, Phase.REPLAYING: 2.0}
    assert sum(stats.seconds.values()) == pytest.approx(clock.now - 50.0)
    assert (stats.generation, stats.step, stats.at) == (2, 12, 7.0)


def test_compute_time_leaves_out_the_wait_for_peers() -> None:
    clock = FakeClock()
    keeper = TimeKeeper(clock=clock)
    keeper.world_ready(3, 0)
    run_steps(keeper, clock, 0, 40, compute=0.2, wait=0.3)
    stats = keeper.stats()
    assert stats.steps_timed == STEP_WINDOW
    assert stats.step_seconds == pytest.approx(0.5)
    assert stats.compute_seconds == pytest.approx(0.2)


def test_a_one_off_pause_does_not_move_the_median() -> None:
    clock = FakeClock()
    keeper = TimeKeeper(clock=clock)
    keeper.world_ready(1, 0)
    run_steps(keeper, clock, 0, 20, compute=0.1)
    run_steps(keeper, clock, 20, 1, compute=30.0)
    run_steps(keeper, clock, 21, 20, compute=0.1)
    assert keeper.stats().compute_seconds == pytest.approx(0.1)


def test_a_new_world_times_its_steps_afresh() -> None:
    clock = FakeClock()
    keeper = TimeKeeper(clock=clock)
    keeper.world_ready(1, 0)
    run_steps(keeper, clock, 0, 20, compute=1.0)
    keeper.forming()
    keeper.world_ready(2, 20)
    run_steps(keeper, clock, 20, 3, compute=0.25)
    stats = keeper.stats()
    assert (stats.steps_timed, stats.compute_seconds) == (3, 0.25)


def test_stats_go_out_at_the_first_step_then_at_gaps_widening_to_the_interval() -> None:
    clock = FakeClock()
    sent: list[MemberStats] = []
    sender = StatsSender(TimeKeeper(clock=clock), sent.append, 80.0, clock=clock)
    assert sender.maybe_send(checkpointIntervalSteps=240, mtbfSeconds=None)
    sends = [clock.now]
    for _ in range(3000):
        clock.now += 0.25
        if sender.maybe_send():
            sends.append(clock.now)
    gaps = [b - a for a, b in itertools.pairwise(sends)]
    assert gaps[:6] == [10.0, 20.0, 40.0, 80.0, 80.0, 80.0]
    assert len(sent) == len(sends)
    assert [s.checkpoint_interval_steps for s in sent[:2]] == [240, 0]
    assert sent[0].mtbf_seconds is None
    assert parse_stats(sent[0].to_json()) == sent[0]


def test_a_short_job_reports_goodput_that_covers_its_training() -> None:
    """Start-up takes 2 s, then 20 s of steps: the last stats sent say most of the time
    trained (with a send only every 30 s, the first, at 2 s, would be the last)."""
    clock = FakeClock()
    sent: list[MemberStats] = []
    keeper = TimeKeeper(clock=clock)
    sender = StatsSender(keeper, sent.append, 30.0, clock=clock)
    clock.now += 2.0
    keeper.world_ready(1, 0)
    for step in range(200):
        clock.now += 0.1
        keeper.stepped(step + 1)
        sender.maybe_send()
    last = sent[-1].seconds
    assert last[Phase.TRAINING] / sum(last.values()) > 0.8, last
