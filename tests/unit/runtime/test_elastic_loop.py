"""The elastic loop with fake collectives: roll back on failure, switch worlds at a
commit without rolling back, leave cleanly when dropped."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import pytest
import torch

from ringwright.runtime.collectives.group import LeftWorld
from ringwright.runtime.elastic import ElasticRuntime, default_backend
from ringwright.runtime.local.launcher import free_port
from ringwright.runtime.sampler import ElasticSampler
from ringwright.runtime.settings import RuntimeSettings
from ringwright.runtime.state import State
from ringwright.world import (
    Backend,
    JobRef,
    LRRule,
    LRScaling,
    Member,
    ReportKind,
    StoreAddress,
    World,
)
from tests.unit.runtime.runtime_fakes import FakeBackend, FakeReporter, FakeSource, make_world

ME = "w-0"
SAMPLES = 24
BATCH = 4


class Trainer:
    """A training function that records what it trained, by attempt."""

    def __init__(self, commit_every: int = 2, epochs: int = 2) -> None:
        self.commit_every = commit_every
        self.epochs = epochs
        self.starts: list[int] = []
        self.trained: list[tuple[int, int, list[int]]] = []
        self.hooks: dict[int, list[object]] = {}

    def __call__(self, state: State) -> str:
        self.starts.append(state.step)
        xs = torch.ones(SAMPLES, 2)
        while state.sampler.epoch < self.epochs:
            epoch, idx = state.sampler.epoch, state.sampler.batch()
            state.optimizer.zero_grad()
            state.model(xs[idx]).sum().backward()
            self.trained.append((state.step + 1, epoch, idx))
            state.allreduce_gradients()
            state.optimizer.step()
            state.advance()
            for hook in self.hooks.get(state.step, []):
                assert callable(hook)
                hook()
            if state.step % self.commit_every == 0:
                state.commit()
        return "done"

    def counted(self) -> dict[int, Counter[int]]:
        """Per data epoch, the samples of the last attempt at each step."""
        last: dict[int, tuple[int, list[int]]] = {}
        for step, epoch, idx in self.trained:
            last[step] = (epoch, idx)
        per_epoch: dict[int, Counter[int]] = {}
        for epoch, idx in last.values():
            per_epoch.setdefault(epoch, Counter()).update(idx)
        return per_epoch


def new_state() -> State:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    return State(model, torch.optim.SGD(model.parameters(), lr=0.1),
                 ElasticSampler(SAMPLES, BATCH))


def runtime(source: FakeSource, backend: FakeBackend, reporter: FakeReporter) -> ElasticRuntime:
    return ElasticRuntime(source, ME, settings=RuntimeSettings(world_wait_timeout_s=5),
                          reporter=reporter, backend_factory=lambda kind, dev, s: backend)


def every_sample_once(trainer: Trainer) -> None:
    for epoch, counts in trainer.counted().items():
        assert counts == Counter(range(SAMPLES)), f"epoch {epoch}: {counts}"


def test_runs_to_completion_in_a_stable_world() -> None:
    source, backend, reporter = FakeSource(), FakeBackend(), FakeReporter()
    lr = LRScaling(rule=LRRule.LINEAR, base_world_size=2)
    source.publish(make_world(0, [ME]).model_copy(update={"lr": lr}))
    trainer, state = Trainer(), new_state()
    with runtime(source, backend, reporter) as rt:
        assert rt.run(trainer, state) == "done"
    assert trainer.starts == [0]
    assert state.step == 2 * SAMPLES // BATCH
    assert state.lr.scaled_lrs() == pytest.approx([0.05])
    assert state.optimizer.param_groups[0]["lr"] == 0.1, "the user's rate is never rewritten"
    assert backend.closed
    every_sample_once(trainer)


def test_a_failed_collective_rolls_back_and_continues_in_the_next_world() -> None:
    source, backend = FakeSource(), FakeBackend()
    backend.fail_gradients_at = {7}
    source.publish(make_world(0, [ME]))

    def operator(kind: ReportKind, generation: int) -> None:
        if kind is ReportKind.COLLECTIVE_FAILED:
            source.publish(make_world(generation + 1, [ME]))

    reporter = FakeReporter(on_report=operator)
    trainer, state = Trainer(commit_every=4), new_state()
    with runtime(source, backend, reporter) as rt:
        rt.run(trainer, state)
    assert trainer.starts == [0, 4], "resumed from the commit at step 4"
    assert [e for e, _ in backend.inits] == [0, 1]
    assert [k for k, _, _ in reporter.reports] == [ReportKind.COLLECTIVE_FAILED]
    every_sample_once(trainer)


def test_a_planned_change_switches_worlds_at_a_commit_without_rollback() -> None:
    source, backend, reporter = FakeSource(), FakeBackend(), FakeReporter()
    source.publish(make_world(0, [ME]))
    trainer, state = Trainer(commit_every=4), new_state()
    trainer.hooks[3] = [lambda: source.publish(make_world(1, [ME]))]
    with runtime(source, backend, reporter) as rt:
        rt.run(trainer, state)
    assert trainer.starts == [0, 4]
    assert reporter.reports == []
    assert len(trainer.trained) == 2 * SAMPLES // BATCH, "no step trained twice"
    every_sample_once(trainer)


def test_dropped_from_the_world_it_leaves_with_status_zero() -> None:
    source, backend, reporter = FakeSource(), FakeBackend(), FakeReporter()
    source.publish(make_world(0, [ME, "w-1"]))
    trainer, state = Trainer(commit_every=2), new_state()
    trainer.hooks[1] = [lambda: source.publish(make_world(1, ["w-1"]))]
    with runtime(source, backend, reporter) as rt, pytest.raises(LeftWorld) as left:
        rt.run(trainer, state)
    assert left.value.code == 0
    assert state.step == 2, "left after finishing the step it was on, at a commit"
    assert [k for k, _, _ in reporter.reports] == [ReportKind.LEFT]


def test_a_runtime_from_a_job_environment_needs_its_pod_name() -> None:
    with pytest.raises(ValueError, match="RINGWRIGHT_POD_NAME"):
        ElasticRuntime.from_env({"RINGWRIGHT_JOB_NAME": "j"})
    with pytest.raises(ValueError, match="RINGWRIGHT_JOB_NAME"):
        ElasticRuntime.from_env({"RINGWRIGHT_POD_NAME": "p"})


def test_a_runtime_following_a_world_file_knows_its_uid(tmp_path: Path) -> None:
    # The local launcher starts every process with its own uid: a process started again
    # must not take its predecessor's entry in a world published before the exit was seen.
    with ElasticRuntime.from_env({"RINGWRIGHT_POD_NAME": "p",
                                  "RINGWRIGHT_POD_UID": "second",
                                  "RINGWRIGHT_WORLD_FILE": str(tmp_path / "world.json")}) as rt:
        assert rt.pod_uid == "second"


def test_without_any_job_environment_the_process_trains_as_a_world_of_one() -> None:
    seen: list[tuple[int, int, int]] = []

    def train(state: State) -> str:
        seen.append((state.rank, state.world_size, state.binding.world.generation))
        return Trainer(commit_every=3)(state)

    state = new_state()
    with ElasticRuntime.from_env({}) as rt:
        assert rt.settings.stall_timeout_s == 0, "a breakpoint is no stall"
        assert rt.run(train, state) == "done"
    assert seen == [(0, 1, 0)]
    assert state.step == 2 * SAMPLES // BATCH
    assert state.lr.scaled_lrs() == [0.1], "no rescaling unless a world asks for it"
    assert ElasticRuntime.from_env(
        {"RINGWRIGHT_STALL_TIMEOUT_SECONDS": "60"}).settings.stall_timeout_s == 60


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_work_inside_state_busy_is_no_stall_and_heartbeats_are_untouched() -> None:
    source, backend, reporter = FakeSource(), FakeBackend(), FakeReporter()
    source.publish(make_world(0, [ME]))
    clock = Clock()
    rt = ElasticRuntime(source, ME, settings=RuntimeSettings(stall_timeout_s=10),
                        reporter=reporter, backend_factory=lambda kind, dev, s: backend,
                        clock=clock)
    verdicts: list[bool] = []

    def train(state: State) -> None:
        clock.now += 11
        verdicts.append(rt.watchdog.check())
        with state.busy():
            clock.now += 1000
            verdicts.append(rt.watchdog.check())
        clock.now += 9
        verdicts.append(rt.watchdog.check())
        clock.now += 2
        verdicts.append(rt.watchdog.check())

    with rt:
        rt.run(train, new_state())
    assert verdicts == [False, True, True, False]
    assert [k for k, _, _ in reporter.reports] == [ReportKind.STALLED, ReportKind.STALLED]
    assert backend.aborted is None and backend.shutdowns == 0, "the group was left alone"


def test_default_backends_by_kind() -> None:
    assert default_backend(Backend.TORCH, torch.device("cpu"), RuntimeSettings()).name == "gloo"
    assert default_backend(Backend.HOROVOD, torch.device("cpu"),
                           RuntimeSettings()).name == "horovod"


def test_the_default_backend_tells_the_heartbeat_lag_to_its_listener() -> None:
    """The seam the runtime's heartbeat-lag gauge hangs on, on a real store."""
    lags: list[float] = []
    told = threading.Event()

    def on_lag(lag: float) -> None:
        lags.append(lag)
        told.set()

    settings = RuntimeSettings(failure_detect_s=0.3, collective_timeout_s=5)
    backend = default_backend(Backend.TORCH, torch.device("cpu"), settings,
                              on_heartbeat_lag=on_lag)
    alone = World(job=JobRef(namespace="local", name="j"), generation=1,
                  members=(Member(rank=0, pod="w-0", ip="127.0.0.1"),),
                  store=StoreAddress(address="127.0.0.1", port=free_port()))
    try:
        backend.init(alone, 0, lambda: False, print)
        assert told.wait(10), "the judge never told the lag"
    finally:
        backend.close()
    assert lags[0] == 0.0, "a world of one has no peer to lag"
