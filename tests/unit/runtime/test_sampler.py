"""The elastic sampler: no sample lost or repeated within an epoch, counting from the
commits, whatever sequence of steps, commits, resizes and rollbacks happens."""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringwright.runtime.sampler import ElasticSampler, StaleIterator


@dataclass
class Job:
    """Every rank's sampler plus the bookkeeping of what was trained and committed."""

    samples: int
    batch: int
    ranks: list[ElasticSampler]
    snapshot: dict[str, object]
    pending: list[tuple[int, list[int]]] = field(default_factory=list)
    committed: dict[int, Counter[int]] = field(default_factory=lambda: defaultdict(Counter))

    @classmethod
    def start(cls, samples: int, batch: int, size: int) -> Job:
        first = ElasticSampler(samples, batch, seed=3)
        job = cls(samples, batch, [], first.state_dict())
        job.rebuild(size)
        return job

    def rebuild(self, size: int) -> None:
        """A new world: every member adopts the committed state, as after a sync."""
        self.ranks = []
        for rank in range(size):
            s = ElasticSampler(self.samples, self.batch, seed=99)
            s.load_state_dict(dict(self.snapshot))
            s.set_world(rank, size)
            self.ranks.append(s)

    def step(self) -> None:
        epoch = self.ranks[0].epoch
        shares = [s.batch() for s in self.ranks]
        flat = [i for share in shares for i in share]
        assert len(flat) == len(set(flat)), f"ranks overlap within a step: {shares}"
        positions = self.ranks[0].global_positions()
        order = self.ranks[0].order()
        assert flat == [order[p] for p in positions], "a step covers its positions in order"
        for s in self.ranks:
            s.advance()
        assert len({str(s.state_dict()) for s in self.ranks}) == 1, "ranks diverged"
        self.pending.append((epoch, flat))

    def commit(self) -> None:
        for epoch, indices in self.pending:
            self.committed[epoch].update(indices)
            repeated = [i for i, n in self.committed[epoch].items() if n > 1]
            assert not repeated, f"epoch {epoch}: committed twice: {repeated}"
        self.pending = []
        self.snapshot = self.ranks[0].state_dict()

    def rollback(self) -> None:
        self.pending = []
        self.rebuild(len(self.ranks))


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("step"), st.integers(1, 5)),
        st.tuples(st.just("commit"), st.just(0)),
        st.tuples(st.just("rollback"), st.just(0)),
        st.tuples(st.just("failure_resize"), st.integers(1, 6)),
        st.tuples(st.just("planned_resize"), st.integers(1, 6)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(samples=st.integers(1, 60), batch=st.integers(1, 6), size=st.integers(1, 6),
       ops=OPS, epochs=st.integers(1, 3))
def test_each_epoch_trains_every_sample_exactly_once_from_the_commits(
        samples: int, batch: int, size: int, ops: list[tuple[str, int]], epochs: int) -> None:
    job = Job.start(samples, batch, size)
    for op, arg in ops:
        if op == "step":
            for _ in range(arg):
                job.step()
        elif op == "commit":
            job.commit()
        elif op == "rollback":
            job.rollback()
        elif op == "failure_resize":
            # A peer died: roll back to the last commit, continue in a new world.
            job.pending = []
            job.rebuild(arg)
        else:
            # A planned resize happens at a commit: nothing is rolled back.
            job.commit()
            job.rebuild(arg)
    while job.ranks[0].epoch < epochs:
        job.step()
    job.commit()
    finished = [e for e in job.committed if e < job.ranks[0].epoch]
    assert finished, "at least one epoch completed"
    for epoch in finished:
        assert job.committed[epoch] == Counter(range(samples)), f"epoch {epoch} incomplete"


@pytest.mark.parametrize(
    ("samples", "batch", "size", "shares"),
    [
        (16, 2, 4, [2, 2, 2, 2]),
        (7, 2, 4, [2, 2, 2, 1]),  # the epoch's last global batch is short
        (3, 2, 4, [1, 1, 1, 0]),  # a rank may get nothing and still take part
        (9, 2, 4, [3, 2, 2, 2]),  # a tail of fewer samples than ranks joins the batch
        (10, 4, 1, [4]),
    ],
)
def test_a_global_batch_is_split_as_evenly_as_possible(
        samples: int, batch: int, size: int, shares: list[int]) -> None:
    ranks = [ElasticSampler(samples, batch, shuffle=False) for _ in range(size)]
    for rank, s in enumerate(ranks):
        s.set_world(rank, size)
    assert [len(s.batch()) for s in ranks] == shares


def test_the_order_is_the_same_on_every_rank_and_changes_per_epoch() -> None:
    a, b = ElasticSampler(50, 5, seed=1), ElasticSampler(50, 5, seed=1)
    b.set_world(3, 4)
    assert list(a.order()) == list(b.order())
    first = list(a.order())
    a.epoch = 1
    assert list(a.order()) != first
    assert sorted(a.order()) == list(range(50))


def test_the_order_follows_seed_epoch_and_shuffle_from_a_loaded_state() -> None:
    s = ElasticSampler(50, 5, seed=1)
    committed = s.state_dict()
    drawn = list(s.order())
    s.advance()
    s.load_state_dict(committed)
    assert list(s.order()) == drawn
    s.load_state_dict({**committed, "seed": 2})
    assert list(s.order()) != drawn
    s.load_state_dict({**committed, "shuffle": False})
    assert list(s.order()) == list(range(50))
    s.load_state_dict({**committed, "epoch": 1})
    assert sorted(s.order()) == list(range(50)) and list(s.order()) != drawn


def test_epoch_rolls_over_after_its_last_batch() -> None:
    s = ElasticSampler(10, 4)
    s.set_world(0, 2)
    s.advance()
    assert (s.epoch, s.offset, s.remaining) == (0, 8, 2)
    s.advance()
    assert (s.epoch, s.offset) == (1, 0)


def test_state_for_another_dataset_is_refused() -> None:
    state = ElasticSampler(10, 2).state_dict()
    with pytest.raises(ValueError, match="10 samples"):
        ElasticSampler(11, 2).load_state_dict(state)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        ElasticSampler(0, 1)
    with pytest.raises(ValueError):
        ElasticSampler(1, 0)
    with pytest.raises(ValueError):
        ElasticSampler(5, 1).set_world(2, 2)


@settings(max_examples=200, deadline=None)
@given(samples=st.integers(1, 80), batch=st.integers(1, 5), size=st.integers(1, 5),
       ahead=st.integers(0, 6),
       ops=st.lists(st.tuples(st.sampled_from(["train", "commit", "rollback", "resize"]),
                              st.integers(1, 5)), max_size=30))
def test_iterators_running_ahead_lose_and_repeat_nothing(
        samples: int, batch: int, size: int, ahead: int,
        ops: list[tuple[str, int]]) -> None:
    """Each rank's batches come from ``iter(sampler)`` pulled ``ahead`` batches beyond
    training, as a data loader prefetches; a rollback or a resize at any offset drops
    the prefetched ones and iterates again from the committed cursor."""
    snapshot = ElasticSampler(samples, batch, seed=5).state_dict()
    ranks: list[ElasticSampler] = []
    queues: list[list[list[int]]] = []
    iterators: list[Iterator[list[int]]] = []

    def world(new_size: int) -> None:
        ranks.clear()
        for rank in range(new_size):
            s = ElasticSampler(samples, batch)
            s.load_state_dict(dict(snapshot))
            s.set_world(rank, new_size)
            ranks.append(s)
        restart()

    def restart() -> None:
        iterators[:] = [iter(s) for s in ranks]
        queues[:] = [[] for _ in ranks]
        for q, it in zip(queues, iterators, strict=True):
            q.extend(itertools.islice(it, ahead))

    world(size)
    committed: dict[int, Counter[int]] = defaultdict(Counter)
    pending: list[tuple[int, int]] = []

    def train() -> None:
        epoch = ranks[0].epoch
        for q, it in zip(queues, iterators, strict=True):
            q.extend(itertools.islice(it, 1))
        if not queues[0]:
            restart()  # the loader ran out: the next epoch's iteration
            return train()
        for q, s in zip(queues, ranks, strict=True):
            pending.extend((epoch, i) for i in q.pop(0))
            s.advance()
        if ranks[0].epoch != epoch:
            restart()
        return None

    def commit() -> None:
        nonlocal snapshot
        for epoch, i in pending:
            committed[epoch][i] += 1
        pending.clear()
        snapshot = ranks[0].state_dict()

    for op, arg in ops:
        if op == "train":
            for _ in range(arg):
                train()
        elif op == "commit":
            commit()
        elif op == "rollback":
            pending.clear()
            world(len(ranks))
        else:
            commit()
            world(arg)
    commit()
    start_epoch = ranks[0].epoch
    while ranks[0].epoch == start_epoch:
        train()
    commit()
    # Every epoch completed so far, counted from the commits, trained each sample once.
    assert sorted(committed) == list(range(ranks[0].epoch))
    for epoch, counts in committed.items():
        assert counts == Counter(range(samples)), f"epoch {epoch}"


def test_an_iterator_from_before_a_rollback_refuses_to_go_on() -> None:
    s = ElasticSampler(40, 2, seed=1)
    s.set_world(0, 2)
    committed = s.state_dict()
    it = iter(s)
    next(it)
    s.load_state_dict(committed)
    with pytest.raises(StaleIterator, match="iterate the loader again"):
        next(it)
    assert next(iter(s)) == s.batch(), "a new iterator starts at the committed cursor"


@given(samples=st.integers(1, 200), batch=st.integers(1, 8), size=st.integers(1, 8))
@settings(max_examples=200)
def test_no_rank_gets_an_empty_batch_while_the_epoch_has_a_sample_per_rank(
        samples: int, batch: int, size: int) -> None:
    """A DataLoader cannot collate an empty batch (``default_collate([])`` raises), so
    a rank's share is empty only when the whole epoch has fewer samples than ranks."""
    ranks = [ElasticSampler(samples, batch) for _ in range(size)]
    for rank, s in enumerate(ranks):
        s.set_world(rank, size)
    steps = [list(s) for s in ranks]
    assert all(len(batches) == len(s) for batches, s in zip(steps, ranks, strict=True))
    assert len({len(batches) for batches in steps}) == 1, "every rank takes every step"
    if samples >= size:
        assert all(b for batches in steps for b in batches)
    trained = Counter(i for batches in steps for b in batches for i in b)
    assert trained == Counter(range(samples))


def test_a_data_loader_with_the_default_collate_reaches_the_end_of_an_uneven_epoch() -> None:
    dataset = torch.utils.data.TensorDataset(torch.arange(13))
    seen: list[int] = []
    for rank in range(3):
        s = ElasticSampler(13, 4)
        s.set_world(rank, 3)
        for (batch,) in torch.utils.data.DataLoader(dataset, batch_sampler=s):
            seen += batch.tolist()
    assert sorted(seen) == list(range(13))


def test_len_counts_the_steps_left_in_the_epoch() -> None:
    s = ElasticSampler(10, 2)
    s.set_world(1, 2)
    assert len(s) == 3 == len(list(s))
    s.advance()
    assert len(s) == 2 == len(list(s))
    assert list(s) == [s.batch(), [s.order()[9]]]


@pytest.mark.parametrize("shuffle", [True, False])
def test_an_iterator_computing_batches_in_chunks_gives_what_batch_gives(shuffle: bool) -> None:
    """Iterators compute many batches' indices in one array pass: the batches are those
    that ``batch()`` and ``advance()`` give one at a time, to the end of the epoch."""
    s, one_by_one = (ElasticSampler(10_000, 32, seed=4, shuffle=shuffle) for _ in range(2))
    for sampler in (s, one_by_one):
        sampler.set_world(1, 3)
        sampler.offset = 96 * 5 + 7  # mid-epoch, as after a resize
    expected = []
    while one_by_one.epoch == 0:
        expected.append(one_by_one.batch())
        one_by_one.advance()
    assert list(s) == expected
