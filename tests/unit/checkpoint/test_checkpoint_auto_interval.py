"""``intervalSteps: Auto``: the Young/Daly interval from the measured step time, write
cost and time between whole-job restarts, within its bounds; every clock is a fake."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from ringwright.runtime.checkpoint.checkpointer import Checkpointer, CheckpointMeta
from ringwright.runtime.checkpoint.policy import (
    AutoInterval,
    RestartHistory,
    auto_interval_steps,
    young_daly_seconds,
)
from ringwright.runtime.checkpoint.storage import LocalStorage
from ringwright.runtime.elastic import ElasticRuntime
from ringwright.runtime.sampler import ElasticSampler
from ringwright.runtime.settings import RuntimeSettings
from ringwright.runtime.state import State
from ringwright.world import CheckpointSettings, Phase
from tests.unit.runtime.runtime_fakes import FakeBackend, FakeReporter, FakeSource, make_world


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_young_daly_is_the_square_root_of_twice_mtbf_times_cost() -> None:
    assert young_daly_seconds(3600.0, 2.0) == pytest.approx(120.0)
    assert young_daly_seconds(0.0, 5.0) == 0.0
    with pytest.raises(ValueError, match="MTBF and cost"):
        young_daly_seconds(-1.0, 1.0)


@pytest.mark.parametrize(
    ("mtbf", "cost", "step", "expected"),
    [
        (3600.0, 2.0, 0.5, 240),  # 120 s of 0.5 s steps
        (3600.0, 2.0, 0.0, 10),  # step time unknown: the lower bound
        (10.0, 0.01, 0.5, 10),  # sqrt(0.2) s is under one step: the lower bound
        (1e9, 100.0, 0.001, 50_000),  # a job that never fails: the upper bound
    ],
)
def test_the_interval_in_steps_is_bounded(mtbf: float, cost: float, step: float,
                                          expected: int) -> None:
    assert auto_interval_steps(mtbf_s=mtbf, cost_s=cost, step_s=step, min_steps=10,
                               max_steps=50_000) == expected


def test_bounds_must_be_ordered() -> None:
    with pytest.raises(ValueError, match="min_steps <= max_steps"):
        auto_interval_steps(mtbf_s=1, cost_s=1, step_s=1, min_steps=5, max_steps=4)
    with pytest.raises(ValueError, match="min_steps <= max_steps"):
        AutoInterval(min_steps=0)


def test_restart_history_mtbf_and_its_stored_form() -> None:
    history = RestartHistory(started_at=1000.0)
    assert history.mtbf(4600.0) == 3600.0, "no restart yet: the time run so far"
    twice = history.restarted().restarted()
    assert twice.restarts == 2
    assert twice.mtbf(4600.0) == 1800.0
    assert RestartHistory.from_dict(twice.to_dict(), now=9e9) == twice
    assert RestartHistory.from_dict(None, now=5.0) == RestartHistory(5.0), \
        "a state saved before the history was kept starts counting now"


def test_auto_interval_follows_measured_steps_and_cost() -> None:
    clock = FakeClock()
    auto = AutoInterval(min_steps=10, max_steps=100_000, clock=clock)
    for _ in range(50):
        clock.now += 0.5
        auto.stepped()
    assert auto.step_s == pytest.approx(0.5)
    assert auto.steps(3600.0) == 10, "no write measured yet: the first checkpoint comes early"
    auto.written(2.0)
    assert auto.steps(3600.0) == 240
    assert auto.steps(4 * 3600.0) == 480, "rarer restarts: twice the interval"
    auto.paused()
    clock.now += 300.0  # a world forming: not a step
    auto.stepped()
    clock.now += 0.5
    auto.stepped()
    assert auto.step_s == pytest.approx(0.5)


def test_slower_steps_mean_fewer_steps_between_checkpoints() -> None:
    clock = FakeClock()
    auto = AutoInterval(clock=clock)
    auto.written(2.0)
    for _ in range(200):
        clock.now += 2.0
        auto.stepped()
    assert auto.steps(3600.0) == math.ceil(120 / 2.0)


STEP_S = 0.5
WRITE_S = 2.0
STEPS = 800


class SlowWriter(Checkpointer):
    """A checkpointer whose writes take ``WRITE_S`` on the fake clock: the write is
    seen done once the training loop's clock has moved past it."""

    def __init__(self, path: Path, clock: FakeClock) -> None:
        super().__init__(LocalStorage(path), keep=100)
        self._fake = clock
        self._done_at = 0.0
        self.saved: list[int] = []

    def save(self, step: int, payload: Mapping[str, Any],
             meta: CheckpointMeta | Mapping[str, Any] | None = None, *,
             copy: bool = True) -> None:
        self.saved.append(step)
        self._done_at = self._fake() + WRITE_S

    def flush(self, timeout: float | None = None) -> bool:
        if timeout is None:
            self._fake.now = max(self._fake.now, self._done_at)
        return self._fake() >= self._done_at


def test_a_job_with_auto_checkpoints_at_the_young_daly_interval(tmp_path: Path) -> None:
    clock, wall = FakeClock(), FakeClock(1e6)
    model = torch.nn.Linear(2, 1)
    state = State(model, torch.optim.SGD(model.parameters(), lr=0.1), ElasticSampler(64, 2),
                  clock=clock, wall_clock=wall)
    writer = SlowWriter(tmp_path, clock)
    state.use_checkpointer(writer)
    # The job has run 3600 s without a restart: MTBF 3600 s, cost 2 s -> 120 s = 240 steps.
    state.history = RestartHistory(started_at=wall.now - 3600.0)

    def train(s: State) -> None:
        while s.step < STEPS:
            clock.now += STEP_S
            s.advance()
            s.commit()

    source = FakeSource()
    source.publish(make_world(0, ["w-0"]).model_copy(update={"checkpoint": CheckpointSettings(
        path=str(tmp_path), intervalAuto=True, autoMinSteps=10, autoMaxSteps=10_000)}))
    with ElasticRuntime(source, "w-0", settings=RuntimeSettings(), reporter=FakeReporter(),
                        backend_factory=lambda k, d, s: FakeBackend()) as rt:
        rt.run(train, state)
    assert writer.saved[0] == 10, "the first checkpoint after autoMinSteps measures the cost"
    gaps = {b - a for a, b in zip(writer.saved[1:], writer.saved[2:], strict=False)}
    assert gaps == {240}, writer.saved
    assert state.checkpoint_interval_steps() == 240


def test_restoring_a_checkpoint_counts_a_whole_job_restart(tmp_path: Path) -> None:
    spec = CheckpointSettings(path=str(tmp_path), intervalSteps=4)
    wall = FakeClock(5000.0)

    def new_state() -> State:
        model = torch.nn.Linear(2, 1)
        return State(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     ElasticSampler(64, 2), wall_clock=wall)

    def run(state: State) -> None:
        def train(s: State) -> None:
            while s.step < 8:
                s.advance()
                s.commit()

        source = FakeSource()
        source.publish(make_world(0, ["w-0"]).model_copy(update={"checkpoint": spec}))
        with ElasticRuntime(source, "w-0", settings=RuntimeSettings(), reporter=FakeReporter(),
                            backend_factory=lambda k, d, s: FakeBackend()) as rt:
            rt.run(train, state)

    first = new_state()
    run(first)
    assert first.history == RestartHistory(5000.0, 0)
    wall.now = 6000.0
    second = new_state()
    run(second)
    assert second.history == RestartHistory(5000.0, 1), \
        "the start time came back with the checkpoint, and the restart was counted"
    assert second.history.mtbf(wall.now) == 1000.0


def test_the_writer_sends_its_interval_cost_and_time_per_phase(tmp_path: Path) -> None:
    clock, wall = FakeClock(), FakeClock(1e6)
    model = torch.nn.Linear(2, 1)
    state = State(model, torch.optim.SGD(model.parameters(), lr=0.1), ElasticSampler(64, 2),
                  clock=clock, wall_clock=wall)
    state.use_checkpointer(SlowWriter(tmp_path, clock))
    state.history = RestartHistory(started_at=wall.now - 3600.0)

    def train(s: State) -> None:
        while s.step < 300:
            clock.now += STEP_S
            s.advance()
            s.commit()

    source = FakeSource()
    source.publish(make_world(0, ["w-0"]).model_copy(update={"checkpoint": CheckpointSettings(
        path=str(tmp_path), intervalAuto=True)}))
    reporter = FakeReporter()
    with ElasticRuntime(source, "w-0", settings=RuntimeSettings(stats_interval_s=10.0),
                        reporter=reporter, clock=clock,
                        backend_factory=lambda k, d, s: FakeBackend()) as rt:
        rt.run(train, state)
    last = reporter.sent_stats[-1]
    assert len(reporter.sent_stats) >= 300 * STEP_S / 10.0 - 1, "every 10 s of the clock"
    assert (last.checkpoint_interval_steps, last.checkpoint_write_seconds) == (240, WRITE_S)
    assert last.mtbf_seconds == 3600.0
    assert last.step_seconds == pytest.approx(STEP_S)
    assert last.seconds[Phase.TRAINING] > 0.9 * last.step * STEP_S
