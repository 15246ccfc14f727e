"""Checkpoint errors are reported, not fatal: training goes on, the failure is logged
and reported with the path and the OS error, retried with a doubling backoff, and the
first good write after it is reported too."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from ringwright.runtime.checkpoint.checkpointer import Checkpointer
from ringwright.runtime.checkpoint.guard import Backoff
from ringwright.runtime.checkpoint.storage import LocalStorage
from ringwright.runtime.sampler import ElasticSampler
from ringwright.runtime.state import State
from ringwright.world import CheckpointSettings
from tests.unit.runtime.runtime_fakes import make_world
from tests.unit.runtime.state_fakes import Binding


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(("failures", "delay"), [(0, 0.0), (1, 5.0), (2, 10.0), (3, 20.0),
                                                  (7, 300.0), (30, 300.0)])
def test_backoff_doubles_up_to_its_cap(failures: int, delay: float) -> None:
    assert Backoff(base_s=5, cap_s=300).delay(failures) == delay


def test_an_unwritable_path_is_reported_and_retried_while_training_goes_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ringwright.runtime")
    blocker = tmp_path / "volume"
    blocker.write_text("a file where the checkpoint folder should be")
    where = blocker / "ckpt"
    clock = Clock()
    model = torch.nn.Linear(2, 1)
    state = State(model, torch.optim.SGD(model.parameters(), lr=0.1), ElasticSampler(8, 2),
                  clock=clock)
    state.use_checkpointer(Checkpointer(LocalStorage(where)), where=str(where))
    reports: list[tuple[str, bool]] = []
    assert state.checkpoints is not None
    state.checkpoints.report = lambda detail, failing: reports.append((detail, failing))
    world = make_world(0, ["w-0"]).model_copy(
        update={"checkpoint": CheckpointSettings(intervalSteps=1)})
    state.bind(Binding(world))
    state.follow_world(world, 0)

    def step_and_commit() -> None:
        model(torch.ones(1, 2)).sum().backward()
        state.optimizer.step()
        state.advance()
        state.commit()  # never raises for the storage's sake

    step_and_commit()                       # the write starts and fails in the background
    step_and_commit()                       # noticed here
    assert len(reports) == 1
    detail, failing = reports[0]
    assert failing and str(where) in detail and "Not a directory" in detail
    assert "checkpoint_failed" in caplog.text and "retry_in_s=5" in caplog.text

    for _ in range(3):                       # backing off: no attempt, no new report
        step_and_commit()
    assert len(reports) == 1
    clock.now = 6.0
    step_and_commit()                        # a retry, failing again
    step_and_commit()
    assert [f for _, f in reports] == [True, True]
    assert state.checkpoints.failures == 2 and "retry_in_s=10" in caplog.text

    blocker.unlink()                         # the volume is fixed
    clock.now = 20.0
    step_and_commit()
    step_and_commit()
    assert reports[-1][1] is False and "written" in reports[-1][0]
    assert state.checkpoints.flush(None)
    restored = Checkpointer(LocalStorage(where)).restore_latest()
    assert restored is not None and restored.payload["step"] >= state.step - 1
