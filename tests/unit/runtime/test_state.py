"""Training state: commit / restore, payloads, and the checkpointer seam."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ringwright.runtime.checkpoint.checkpointer import Checkpointer as DiskCheckpointer
from ringwright.runtime.checkpoint.storage import LocalStorage
from ringwright.runtime.sampler import ElasticSampler
from ringwright.runtime.state import Checkpointer, State
from ringwright.world import CheckpointSettings
from tests.unit.runtime.runtime_fakes import make_world
from tests.unit.runtime.state_fakes import Binding

SAMPLES = 32


def new_state(seed: int = 0, checkpointer: Checkpointer | None = None,
              extra: dict[str, Any] | None = None) -> State:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return State(model, opt, ElasticSampler(SAMPLES, 4), checkpointer=checkpointer,
                 extra=extra)


def bound(state: State, **world_fields: object) -> Binding:
    world = make_world(0, ["w-0"]).model_copy(update=world_fields)
    binding = Binding(world)
    state.bind(binding)
    state.follow_world(world, 0)
    return binding


def train_steps(state: State, n: int) -> None:
    xs = torch.randn(SAMPLES, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(n):
        idx = state.sampler.batch()
        state.optimizer.zero_grad()
        state.model(xs[idx]).pow(2).mean().backward()
        state.allreduce_gradients()
        state.optimizer.step()
        state.advance()


def params(state: State) -> list[torch.Tensor]:
    return [p.detach().clone() for p in state.model.parameters()]


def adam_moments(state: State) -> list[torch.Tensor]:
    return [s["exp_avg"].clone() for s in state.optimizer.state.values()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_restore_rolls_everything_back_to_the_commit_every_time() -> None:
    state = new_state(extra={"extra_value": 1})
    binding = bound(state)
    train_steps(state, 3)
    state.extra["extra_value"] = 2
    state.commit()
    committed = (params(state), adam_moments(state), state.sampler.state_dict(), state.step)
    for _ in range(2):
        train_steps(state, 2)
        state.extra["extra_value"] = 3
        assert not same(params(state), committed[0])
        state.restore()
        # Training after a restore must not write through into the snapshot.
        assert same(params(state), committed[0])
        assert same(adam_moments(state), committed[1])
        assert (state.sampler.state_dict(), state.step) == (committed[2], committed[3])
        assert state.extra == {"extra_value": 2}
    assert binding.progress_calls > 0


def test_restore_before_any_commit_is_an_error() -> None:
    state = new_state()
    with pytest.raises(RuntimeError, match="nothing committed"):
        state.restore()


def test_a_payload_is_a_host_copy_that_another_member_can_load() -> None:
    source = new_state(seed=1)
    bound(source)
    train_steps(source, 2)
    payload = source.to_payload()
    at_payload = (params(source), adam_moments(source), source.sampler.state_dict())
    train_steps(source, 1)  # the payload must not follow the live state
    other = new_state(seed=2)
    bound(other)
    assert not same(params(other), at_payload[0])
    other.load_payload(payload)
    assert other.step == 2
    assert all(t.device.type == "cpu" for t in payload["model"].values())
    assert same(params(other), at_payload[0])
    assert same(adam_moments(other), at_payload[1])
    assert other.sampler.state_dict() == at_payload[2]
    with pytest.raises(ValueError, match="payload format"):
        other.load_payload({"format": 0})


def test_the_optimizer_lr_follows_the_world_after_loading_a_payload() -> None:
    state = new_state()
    bound(state)
    payload = state.to_payload()
    state.optimizer.param_groups[0]["lr"] = 123.0
    state.load_payload(payload)
    assert state.optimizer.param_groups[0]["lr"] == pytest.approx(0.01)


def test_the_disk_checkpointer_fits_the_seam(tmp_path: Path) -> None:
    disk: Checkpointer = DiskCheckpointer(LocalStorage(tmp_path), keep=2)
    state = new_state(checkpointer=disk)
    bound(state, checkpoint=CheckpointSettings(intervalSteps=2))
    for _ in range(5):
        train_steps(state, 1)
        state.commit()
    assert isinstance(disk, DiskCheckpointer)
    disk.flush()
    assert disk.steps() == [2, 4]
    fresh = new_state(seed=5, checkpointer=DiskCheckpointer(LocalStorage(tmp_path)))
    bound(fresh)
    assert fresh.restore_checkpoint()
    assert fresh.step == 4
    assert fresh.sampler.state_dict() == {**state.sampler.state_dict(), "offset": 16}


def test_only_rank_zero_checkpoints(tmp_path: Path) -> None:
    disk = DiskCheckpointer(LocalStorage(tmp_path))
    state = new_state(checkpointer=disk)
    world = make_world(0, ["w-0", "w-1"]).model_copy(
        update={"checkpoint": CheckpointSettings(intervalSteps=1)})
    state.bind(Binding(world, rank=1))
    state.follow_world(world, 1)
    train_steps(state, 1)
    state.commit()
    disk.flush()
    assert disk.steps() == []


def test_without_a_checkpointer_there_is_nothing_to_restore() -> None:
    state = new_state()
    bound(state)
    assert not state.restore_checkpoint()


def test_an_unbound_state_says_how_to_use_it() -> None:
    with pytest.raises(RuntimeError, match="run\\(\\)"):
        new_state().commit()


def test_rank_and_world_size_follow_the_world_the_state_trains_in() -> None:
    state = new_state()
    with pytest.raises(RuntimeError, match=r"run\(\)"):
        _ = state.rank
    world = make_world(3, ["w-0", "w-1", "w-2"])
    state.bind(Binding(world, rank=2))
    assert (state.rank, state.world_size) == (2, 3)


def test_local_rank_is_zero_unless_local_rank_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    state = new_state()
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert state.local_rank == 0
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert state.local_rank == 3
    monkeypatch.setenv("LOCAL_RANK", "three")
    with pytest.raises(ValueError, match="LOCAL_RANK='three'"):
        _ = state.local_rank
