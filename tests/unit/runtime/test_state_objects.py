"""Named stateful objects and RNG states: committed, rolled back, sent to newcomers by
tensor broadcast (no pickled optimizer), checkpointed; a sync that would move nothing
is skipped."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
from torch.optim import lr_scheduler

from ringwright.runtime.checkpoint.checkpointer import Checkpointer
from ringwright.runtime.checkpoint.storage import LocalStorage
from ringwright.runtime.collectives.group import MemberInfo
from ringwright.runtime.rng import RNGMode
from ringwright.runtime.sampler import ElasticSampler
from ringwright.runtime.state import State
from ringwright.runtime.state_sync import needs_state, shared_commit
from ringwright.world import World
from tests.unit.runtime.runtime_fakes import make_world
from tests.unit.runtime.state_fakes import Binding, PairBackend, Wire

SAMPLES = 32


class Counter:
    """A user object with its own state_dict: the issue's "user counters"."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = int(state["seen"])


def new_state(seed: int = 0, rng: RNGMode = RNGMode.SHARED, **kw: Any) -> State:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5),
                                torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return State(model, opt, ElasticSampler(SAMPLES, 4), rng=rng,
                 scheduler=lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=100),
                 plateau=lr_scheduler.ReduceLROnPlateau(opt),
                 scaler=torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3),
                 counter=Counter(), extra={"best": 1.5}, **kw)


def world(size: int = 1, generation: int = 0) -> World:
    return make_world(generation, [f"w-{i}" for i in range(size)])


def join(state: State, w: World, rank: int = 0, backend: PairBackend | None = None) -> None:
    state.bind(Binding(w, rank, backend))
    state.follow_world(w, rank)


def train(state: State, steps: int) -> None:
    xs = torch.randn(SAMPLES, 4, generator=torch.Generator().manual_seed(1))
    scaler = state.objects["scaler"]
    assert isinstance(scaler, torch.amp.GradScaler)
    for _ in range(steps):
        idx = state.sampler.batch()
        state.optimizer.zero_grad()
        scaler.scale(state.model(xs[idx]).pow(2).mean()).backward()
        state.allreduce_gradients()
        scaler.step(state.optimizer)
        scaler.update()
        state.objects["scheduler"].state_dict()  # touched like a user would
        lr_step = state.objects["scheduler"]
        assert isinstance(lr_step, lr_scheduler.OneCycleLR)
        lr_step.step()
        counter = state.objects["counter"]
        assert isinstance(counter, Counter)
        counter.seen += len(idx)
        state.advance()


def draws() -> tuple[float, float, float]:
    return random.random(), float(numpy.random.rand()), float(torch.rand(1))


def snapshot(state: State) -> dict[str, Any]:
    """Everything a resize must carry, as comparable values."""
    scaler = state.objects["scaler"]
    assert isinstance(scaler, torch.amp.GradScaler)
    return {
        "params": [p.detach().clone() for p in state.model.parameters()],
        "moments": [(s["exp_avg"].clone(), s["exp_avg_sq"].clone(), float(s["step"]))
                    for s in state.optimizer.state.values()],
        "lr": [g["lr"] for g in state.optimizer.param_groups],
        "objects": {n: o.state_dict() for n, o in state.objects.items()
                    if n not in ("scaler",)},
        "scale": (scaler.get_scale(), scaler.state_dict()["_growth_tracker"]),
        "step": state.step,
        "extra": dict(state.extra),
    }


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
    assert len(a["moments"]) == len(b["moments"]) > 0
    for (m1, v1, s1), (m2, v2, s2) in zip(a["moments"], b["moments"], strict=True):
        assert torch.equal(m1, m2) and torch.equal(v1, v2) and s1 == s2
    for key in ("lr", "objects", "scale", "step", "extra"):
        assert a[key] == b[key], key


def test_objects_are_told_apart_from_plain_values() -> None:
    state = new_state()
    assert set(state.objects) == {"scheduler", "plateau", "scaler", "counter"}
    assert state.extra == {"best": 1.5}
    state.track("ema", torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="state_dict"):
        state.track("best", Counter())


def test_an_unknown_keyword_is_refused_naming_what_state_accepts() -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError) as refused:
        State(model, opt, ElasticSampler(SAMPLES, 4),
              compression="fp16")  # type: ignore[arg-type]
    message = str(refused.value)
    for accepted in ("compression='fp16'", "checkpointer", "checkpoint_policy", "rng", "seed",
                     "buckets", "extra", "state_dict() and load_state_dict()",
                     "extra={'compression': ...}"):
        assert accepted in message, (accepted, message)
    with pytest.raises(TypeError, match="tensor"):
        State(model, opt, ElasticSampler(SAMPLES, 4),
              ema=torch.zeros(3))  # type: ignore[arg-type]


def test_objects_go_by_keyword_and_plain_values_in_extra() -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"pass it as State\(\.\.\., counter=\.\.\.\)"):
        State(model, opt, ElasticSampler(SAMPLES, 4), extra={"counter": Counter()})
    with pytest.raises(ValueError, match="both"):
        State(model, opt, ElasticSampler(SAMPLES, 4), counter=Counter(), extra={"counter": 1})


def test_objects_and_rng_roll_back_to_the_commit() -> None:
    state = new_state()
    join(state, world())
    train(state, 4)
    state.commit()
    committed = snapshot(state)
    after_commit = draws()
    for _ in range(2):
        train(state, 3)
        scaler = state.objects["scaler"]
        assert isinstance(scaler, torch.amp.GradScaler)
        scaler.update(new_scale=7.0)
        assert snapshot(state)["scale"] != committed["scale"]
        state.restore()
        assert_same(snapshot(state), committed)
        assert draws() == after_commit, "the generators replay the same numbers"


def test_a_newcomer_receives_everything_by_tensor_broadcast_without_pickled_tensors() -> None:
    wire = Wire()
    source = new_state(seed=1)
    join(source, world(1))
    train(source, 5)
    source.commit()
    src_backend, new_backend = PairBackend(wire, 0), PairBackend(wire, 1)
    w = world(2, generation=1)
    source.bind(Binding(w, 0, src_backend))
    newcomer = new_state(seed=2)
    newcomer.bind(Binding(w, 1, new_backend))
    source_draws_state = snapshot(source)
    source.sync(0)
    newcomer.sync(0)
    assert_same(snapshot(newcomer), source_draws_state)

    (skeleton,) = src_backend.objects_sent
    assert not contains_tensor(skeleton), "tensors travel by tensor broadcast, not pickled"
    tensor_bytes = sum(t.numel() * t.element_size() for t in wire.tensors[0])
    assert tensor_bytes > 0 and source.sync_bytes == newcomer.sync_bytes > tensor_bytes


def test_shared_rng_reaches_newcomers() -> None:
    wire = Wire()
    source, newcomer = new_state(seed=1), new_state(seed=2)
    w = world(2)
    source.bind(Binding(w, 0, PairBackend(wire, 0)))
    newcomer.bind(Binding(w, 1, PairBackend(wire, 1)))
    torch.manual_seed(99)
    random.seed(99)
    source.sync(0)
    expected = draws()
    torch.manual_seed(5)
    random.seed(5)
    newcomer.sync(0)
    assert draws() == expected


def contains_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(contains_tensor(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(contains_tensor(v) for v in obj)
    return False


def info(generation: int, step: int, rank: int = 0) -> MemberInfo:
    return MemberInfo(f"p{rank}", generation, rank, step)


@pytest.mark.parametrize(
    ("infos", "skip"),
    [
        ([info(3, 40, 0), info(3, 40, 1)], True),          # planned scale-down at a commit
        ([info(3, 40, 2)], True),
        ([info(3, 40, 0), info(-1, 0, 1)], False),          # a newcomer holds nothing
        ([info(3, 40, 0), info(3, 36, 1)], False),          # rolled back to different commits
        ([info(3, 40, 0), info(2, 40, 1)], False),          # synced in another world
        ([info(-1, 0, 0), info(-1, 0, 1)], False),          # a fresh job
    ],
)
def test_sync_is_skipped_only_when_every_member_holds_the_same_commit(
        infos: list[MemberInfo], skip: bool) -> None:
    assert shared_commit(infos) is skip


@pytest.mark.parametrize(
    ("infos", "src", "receivers"),
    [
        ([info(3, 40, 0), info(3, 40, 1), info(-1, 0, 2)], 0, [2]),  # a join: the newcomer
        ([info(3, 40, 0), info(3, 36, 1), info(2, 40, 2)], 0, None),  # nobody else holds it
        ([info(-1, 0, 0), info(-1, 0, 1)], 0, None),                  # a fresh job
        ([info(3, 40, 0), info(3, 40, 1)], 1, []),                    # everyone holds it
    ],
)
def test_the_state_goes_only_to_the_members_that_lack_the_sources_commit(
        infos: list[MemberInfo], src: int, receivers: list[int] | None) -> None:
    assert needs_state(infos, src) == receivers


def test_on_a_join_the_newcomer_receives_the_state_and_the_survivors_keep_theirs() -> None:
    survivors = [new_state(seed=1), new_state(seed=3)]
    join(survivors[0], world(1))
    train(survivors[0], 3)
    survivors[0].commit()
    first, before = Wire(), world(2)
    for rank, survivor in enumerate(survivors):  # the survivors' own world, synced
        survivor.bind(Binding(before, rank, PairBackend(first, rank)))
        survivor.sync(0)
        survivor.follow_world(before, rank)
    wire, w = Wire(), world(3, generation=1)
    for rank, survivor in enumerate(survivors):
        survivor.bind(Binding(w, rank, PairBackend(wire, rank)))
    newcomer = new_state(seed=2)
    newcomer.bind(Binding(w, 2, PairBackend(wire, 2)))
    expected = snapshot(survivors[0])
    for rank, member in enumerate([*survivors, newcomer]):
        member.sync(0, receivers=[2])
        member.follow_world(w, rank)
    assert_same(snapshot(newcomer), expected)
    assert_same(snapshot(survivors[1]), expected)
    # Only the newcomer's copy moved (and the source's send): the other survivor
    # received nothing beyond the small skeleton.
    assert newcomer.sync_bytes == survivors[0].sync_bytes > survivors[1].sync_bytes
    assert len(wire.tensors) == 1


def test_a_skipped_sync_moves_nothing_and_keeps_the_state() -> None:
    state = new_state()
    join(state, world(2), 0, PairBackend(Wire(), 0))
    train(state, 3)
    state.commit()
    before = snapshot(state)
    state.sync(0, skip=True)
    state.follow_world(world(1, generation=1), 0)
    assert state.sync_bytes == 0
    assert_same(snapshot(state), before)


def test_per_rank_rng_streams_differ_by_rank_and_replay_from_a_commit() -> None:
    a, b = new_state(rng=RNGMode.PER_RANK), new_state(rng=RNGMode.PER_RANK)
    w = world(2)
    join(a, w, 0)
    first_a = draws()
    join(b, w, 1)
    first_b = draws()
    assert first_a != first_b, "each rank draws its own stream"
    a.bind(Binding(w, 0))
    a.follow_world(w, 0)
    assert draws() == first_a, "the same rank, step and world size give the same stream"
    train(a, 2)
    a.commit()
    train(a, 2)
    a.restore()
    replayed = draws()
    train(a, 3)
    a.restore()
    assert draws() == replayed, "a rollback to a commit reseeds from (seed, step, rank, size)"
    assert "rng" not in a.to_payload(), "per-rank streams are derived, not carried"


def test_objects_and_rng_survive_a_checkpoint(tmp_path: Path) -> None:
    disk = Checkpointer(LocalStorage(tmp_path))
    state = new_state(checkpointer=disk)
    join(state, world())
    train(state, 6)
    plateau = state.objects["plateau"]
    assert isinstance(plateau, lr_scheduler.ReduceLROnPlateau)
    plateau.step(2.0)
    state.commit()
    assert state.save_checkpoint()
    disk.flush()
    committed, after = snapshot(state), draws()

    fresh = new_state(seed=7, checkpointer=Checkpointer(LocalStorage(tmp_path)))
    join(fresh, world())
    assert fresh.restore_checkpoint()
    assert_same(snapshot(fresh), committed)
    assert draws() == after
