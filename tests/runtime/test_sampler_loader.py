"""A torch DataLoader with worker processes driven by the elastic sampler: its workers
prefetch batches ahead of training, and after a rollback or a world change the epoch
goes on exactly from the commit, whatever had been prefetched.

The dataset returns each sample's index, so what is counted is what a training step
received from the loader, not what the sampler meant to hand out.
"""

from __future__ import annotations

import os
import signal
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from ringwright.runtime.elastic import ElasticRuntime
from ringwright.runtime.local.launcher import LocalJob
from ringwright.runtime.sampler import ElasticSampler, StaleIterator
from ringwright.runtime.settings import RuntimeSettings
from ringwright.runtime.state import State
from ringwright.world import Env, ReportKind
from tests.runtime.elastic_traces import (
    Traces,
    assert_resumed_from_commit,
    assert_resumed_from_last_commit,
)
from tests.runtime.test_elastic_processes import (
    WORKER,
    audit,
    finish,
    hold_late,
    wait_for_step,
)
from tests.unit.runtime.runtime_fakes import FakeBackend, FakeReporter, FakeSource, make_world

SAMPLES = 40
BATCH = 2
ME = "w-0"

pytestmark = pytest.mark.timeout(420)


class Indices(Dataset[int]):
    """Sample ``i`` is ``i``."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> int:
        return i


class CountingSampler(ElasticSampler):
    """Counts the batches its iterators handed to the loader."""

    sampled = 0

    def __iter__(self) -> Iterator[list[int]]:
        for batch in super().__iter__():
            self.sampled += 1
            yield batch


def loader(sampler: ElasticSampler) -> DataLoader[int]:
    return DataLoader(Indices(), batch_sampler=sampler, num_workers=2, persistent_workers=True,
                      prefetch_factor=2)


def test_a_rollback_discards_prefetched_batches_and_goes_on_from_the_commit() -> None:
    sampler = CountingSampler(SAMPLES, BATCH, seed=3)
    sampler.set_world(0, 1)
    data = loader(sampler)
    trained: Counter[int] = Counter()
    pending: list[int] = []
    committed = sampler.state_dict()

    def train(steps: int) -> None:
        for batch in data:
            pending.extend(batch.tolist())
            sampler.advance()
            steps -= 1
            if steps == 0:
                return

    train(5)
    trained.update(pending)
    pending.clear()
    committed = sampler.state_dict()
    train(3)
    assert sampler.sampled > 8, "the loader had prefetched beyond the trained batches"
    # A failure: the three uncommitted steps are rolled back.
    pending.clear()
    sampler.load_state_dict(committed)
    train(SAMPLES)  # to the end of the epoch
    trained.update(pending)
    assert sampler.epoch == 1
    assert trained == Counter(range(SAMPLES))


def test_an_iterator_kept_across_a_rollback_fails_rather_than_train_stale_batches() -> None:
    sampler = ElasticSampler(SAMPLES, BATCH, seed=3)
    sampler.set_world(0, 1)
    batches = iter(loader(sampler))
    committed = sampler.state_dict()
    next(batches)
    sampler.advance()
    sampler.load_state_dict(committed)
    with pytest.raises(StaleIterator):
        # The prefetched batches may come out first; the next one asked for fails.
        for _ in range(SAMPLES):
            next(batches)


class LoaderTrainer:
    """A training function iterating a DataLoader, recording what each step received."""

    def __init__(self, state: State, commit_every: int, epochs: int) -> None:
        self.loader = loader(state.sampler)
        self.commit_every, self.epochs = commit_every, epochs
        self.starts: list[int] = []
        self.trained: dict[int, tuple[int, list[int]]] = {}
        """Step -> (epoch, indices) of its last attempt."""

    def __call__(self, state: State) -> str:
        self.starts.append(state.step)
        while state.sampler.epoch < self.epochs:
            for batch in self.loader:
                epoch = state.sampler.epoch
                state.optimizer.zero_grad()
                state.model(torch.ones(len(batch), 2)).sum().backward()
                self.trained[state.step + 1] = (epoch, batch.tolist())
                state.allreduce_gradients()
                state.optimizer.step()
                state.advance()
                if state.step % self.commit_every == 0 or state.sampler.epoch != epoch:
                    state.commit()
        return "done"


def test_the_runtime_rolls_back_a_loader_with_prefetching_workers_exactly() -> None:
    source, backend = FakeSource(), FakeBackend()
    # Calls 7 and 31 are steps 7 (epoch 0) and 28 (epoch 1, after step 7's retry):
    # mid-epoch, three steps after a commit, with batches prefetched.
    backend.fail_gradients_at = {7, 31}
    source.publish(make_world(0, [ME]))

    def operator(kind: ReportKind, generation: int) -> None:
        if kind is ReportKind.COLLECTIVE_FAILED:
            source.publish(make_world(generation + 1, [ME]))

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    sampler = CountingSampler(SAMPLES, BATCH, seed=1)
    state = State(model, torch.optim.SGD(model.parameters(), lr=0.1), sampler)
    trainer = LoaderTrainer(state, commit_every=4, epochs=2)
    with ElasticRuntime(source, ME, settings=RuntimeSettings(world_wait_timeout_s=5),
                        reporter=FakeReporter(on_report=operator),
                        backend_factory=lambda kind, dev, s: backend) as rt:
        assert rt.run(trainer, state) == "done"
    assert trainer.starts == [0, 4, 24], "resumed from the commits before the failures"
    assert sampler.sampled > state.step, "the loader sampled batches that were never trained"
    per_epoch: dict[int, Counter[int]] = defaultdict(Counter)
    for epoch, indices in trainer.trained.values():
        per_epoch[epoch].update(indices)
    assert sorted(per_epoch) == [0, 1]
    for epoch, counts in per_epoch.items():
        assert counts == Counter(range(SAMPLES)), f"epoch {epoch}: {counts}"


SHARD_SIZES = "50,7,0,61,30,44"
"""Uneven shards of the workers' 192 samples (one empty)."""


@pytest.fixture(params=["sampler", "shards"])
def loader_job(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LocalJob]:
    """Workers of elastic_worker.py that draw their samples through a DataLoader with
    four worker processes each (the sample counts of test_elastic_processes.py): the
    elastic batch sampler over a map-style dataset, or leased shards."""
    env = {
        Env.BACKEND: "torch",
        "TRACE_DIR": str(tmp_path / "trace"),
        "EPOCHS": "2",
        "SAMPLES": "192",
        "BATCH": "4",
        "COMMIT_EVERY": "4",
        "STEP_SLEEP": "0.03",
        "LOADER_WORKERS": "4",
        "GATE_FILE": str(tmp_path / "gate"),
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        "OMP_NUM_THREADS": "1",
    }
    if request.param == "shards":
        env["SHARD_SIZES"] = SHARD_SIZES
    with LocalJob([sys.executable, str(WORKER)], tmp_path, env=env) as local_job:
        yield local_job


def loader_pids(job: LocalJob, pod: str) -> list[int]:
    """The DataLoader worker processes of ``pod``'s training process."""
    trainer = Traces.load(job.workdir / "trace").pids(pod)[-1]
    return [child.pid for child in psutil.Process(trainer).children()]


def test_sigkill_with_loader_workers_every_sample_trained_once(loader_job: LocalJob) -> None:
    """A member dies while every member's loader has batches prefetched by its four
    workers: the survivors roll back and their loaders start again at the commit;
    counting the indices the loaders delivered to the surviving attempt of each step,
    every sample of each epoch was trained exactly once."""
    gate = hold_late(loader_job)
    loader_job.start(3)
    wait_for_step(loader_job, 6)
    survivor = loader_job.world.members[0].pod
    assert len(loader_pids(loader_job, survivor)) == 4, "four loader workers per member"
    victim = loader_job.world.members[1].pod
    loader_job.kill(victim, signal.SIGKILL)
    gate.unlink()
    codes = finish(loader_job)

    assert codes[victim] == -signal.SIGKILL
    assert loader_job.world.size == 2 and loader_job.world.generation == 1
    t = audit(loader_job)
    assert_resumed_from_commit(t, before=0, after=1)
    assert {r["size"] for r in t.starts(1).values()} == {2}


def test_a_killed_loader_worker_takes_its_member_out_and_the_rest_goes_on_exactly(
        loader_job: LocalJob) -> None:
    """SIGKILL one of a member's four loader workers: the loader raises in that member,
    which fails like a dead member (as a plain DDP job would fail as a whole); the
    others roll back to the commit and finish, every sample of each epoch trained once."""
    gate = hold_late(loader_job)
    loader_job.start(3)
    wait_for_step(loader_job, 6)
    victim = loader_job.world.members[1].pod
    os.kill(loader_pids(loader_job, victim)[2], signal.SIGKILL)
    gate.unlink()
    codes = finish(loader_job)

    assert codes[victim] not in (0, None), "the member whose loader lost a worker failed"
    assert loader_job.world.size == 2
    t = audit(loader_job)
    # The member's loader fails on its next batch, so its peers may see it fail in a
    # collective and re-form with it still alive before its exit takes it out: one world
    # or two, each without a commit of its own until the last.
    assert_resumed_from_last_commit(t, after=t.generations()[-1])
