"""The job's spec.checkpoint drives checkpoints with no script code; what the script
configures itself wins (its checkpointer: where and how many; its policy: when)."""

from __future__ import annotations

from pathlib import Path

import torch

from ringwright.runtime.checkpoint.checkpointer import Checkpointer
from ringwright.runtime.checkpoint.policy import CheckpointPolicy
from ringwright.runtime.checkpoint.storage import LocalStorage
from ringwright.runtime.elastic import ElasticRuntime
from ringwright.runtime.sampler import ElasticSampler
from ringwright.runtime.settings import RuntimeSettings
from ringwright.runtime.state import State
from ringwright.world import CheckpointSettings
from tests.unit.runtime.runtime_fakes import FakeBackend, FakeReporter, FakeSource, make_world

ME = "w-0"
STEPS = 12


def train(state: State) -> None:
    while state.step < STEPS:
        state.model(torch.ones(1, 2)).sum().backward()
        state.optimizer.step()
        state.advance()
        state.commit()


def run_job(spec: CheckpointSettings, state: State) -> None:
    source = FakeSource()
    source.publish(make_world(0, [ME]).model_copy(update={"checkpoint": spec}))
    rt = ElasticRuntime(source, ME, settings=RuntimeSettings(), reporter=FakeReporter(),
                        backend_factory=lambda k, d, s: FakeBackend())
    with rt:
        rt.run(train, state)


def new_state(checkpointer: Checkpointer | None = None,
              checkpoint_policy: CheckpointPolicy | None = None) -> State:
    model = torch.nn.Linear(2, 1)
    return State(model, torch.optim.SGD(model.parameters(), lr=0.1), ElasticSampler(64, 2),
                 checkpointer=checkpointer, checkpoint_policy=checkpoint_policy)


def steps_in(path: Path) -> list[int]:
    return Checkpointer(LocalStorage(path)).steps()


def test_the_spec_alone_builds_the_checkpointer(tmp_path: Path) -> None:
    spec = CheckpointSettings(path=str(tmp_path / "job"), intervalSteps=4, keep=2)
    state = new_state()
    run_job(spec, state)
    assert isinstance(state.checkpointer, Checkpointer)
    assert steps_in(tmp_path / "job") == [8, 12], "every 4 steps, the newest 2 kept"

    resumed = new_state()
    run_job(spec, resumed)
    assert resumed.step == STEPS, "a fresh job resumed from the newest checkpoint"


def test_the_scripts_checkpointer_wins_over_the_spec_path_and_keep(tmp_path: Path) -> None:
    spec = CheckpointSettings(path=str(tmp_path / "job"), intervalSteps=4, keep=1)
    mine = Checkpointer(LocalStorage(tmp_path / "mine"), keep=3)
    state = new_state(checkpointer=mine)
    run_job(spec, state)
    mine.flush()
    assert state.checkpointer is mine
    assert steps_in(tmp_path / "mine") == [4, 8, 12]
    assert not (tmp_path / "job").exists()


def test_the_scripts_policy_wins_over_the_spec_intervals(tmp_path: Path) -> None:
    spec = CheckpointSettings(path=str(tmp_path / "job"), intervalSteps=2, keep=10)
    state = new_state(checkpoint_policy=CheckpointPolicy(interval_steps=5))
    run_job(spec, state)
    assert steps_in(tmp_path / "job") == [5, 10]


def test_without_a_path_or_a_checkpointer_nothing_is_written(tmp_path: Path) -> None:
    state = new_state()
    run_job(CheckpointSettings(intervalSteps=1), state)
    assert state.checkpointer is None
