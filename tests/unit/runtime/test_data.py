"""Leased shards: every sample of every shard trained once per epoch counting from the
commits, whatever steps, commits, rollbacks and resizes happen; ranks read their shards
front to back; every rank stays busy until the epoch's last steps."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringwright.runtime.data import ElasticShards
from ringwright.runtime.sampler import StaleIterator


@dataclass
class Job:
    """Every rank's ElasticShards plus the bookkeeping of what was trained and committed."""

    sizes: list[int]
    batch: int
    ranks: list[ElasticShards]
    snapshot: dict[str, object]
    pending: list[tuple[int, list[int]]] = field(default_factory=list)
    committed: dict[int, Counter[int]] = field(default_factory=lambda: defaultdict(Counter))
    short_steps: int = 0

    @classmethod
    def start(cls, sizes: list[int], batch: int, size: int) -> Job:
        job = cls(sizes, batch, [], ElasticShards(sizes, batch, seed=3).state_dict())
        job.rebuild(size)
        return job

    def rebuild(self, size: int) -> None:
        """A new world: every member adopts the committed state, as after a sync."""
        self.ranks = []
        for rank in range(size):
            s = ElasticShards(self.sizes, self.batch, seed=99)
            s.load_state_dict(dict(self.snapshot))
            s.set_world(rank, size)
            self.ranks.append(s)

    def step(self) -> None:
        first = self.ranks[0]
        epoch, left, size = first.epoch, first.remaining, len(self.ranks)
        shares = [s.batch() for s in self.ranks]
        flat = [i for share in shares for i in share]
        assert len(flat) == len(set(flat)), f"ranks overlap within a step: {shares}"
        assert flat, f"a step trained nothing with {left} samples left"
        assert len(flat) == len(first.global_positions())
        if any(len(share) < self.batch for share in shares):
            # A rank runs short only when at most one sample per lease is left after
            # the full shares: the epoch's last steps.
            assert left <= size * (self.batch + 1), f"short batch with {left} samples left"
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


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("step"), st.integers(1, 6)),
        st.tuples(st.just("commit"), st.just(0)),
        st.tuples(st.just("rollback"), st.just(0)),
        st.tuples(st.just("failure_resize"), st.integers(1, 6)),
        st.tuples(st.just("planned_resize"), st.integers(1, 6)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(0, 30), min_size=1, max_size=8).filter(any),
       batch=st.integers(1, 6), size=st.integers(1, 6), ops=OPS, epochs=st.integers(1, 3))
def test_each_epoch_trains_every_sample_of_every_shard_once_from_the_commits(
        sizes: list[int], batch: int, size: int, ops: list[tuple[str, int]],
        epochs: int) -> None:
    job = Job.start(sizes, batch, size)
    for op, arg in ops:
        if op == "step":
            for _ in range(arg):
                job.step()
        elif op == "commit":
            job.commit()
        elif op == "rollback":
            job.pending = []
            job.rebuild(len(job.ranks))
        elif op == "failure_resize":
            job.pending = []
            job.rebuild(arg)
        else:
            job.commit()
            job.rebuild(arg)
    while job.ranks[0].epoch < epochs:
        job.step()
    job.commit()
    finished = [e for e in job.committed if e < job.ranks[0].epoch]
    assert finished, "at least one epoch completed"
    for epoch in finished:
        assert job.committed[epoch] == Counter(range(sum(sizes))), f"epoch {epoch} incomplete"


def test_each_rank_reads_its_shard_front_to_back_until_the_tail() -> None:
    sizes = [40, 40, 40, 40]
    shards = ElasticShards(sizes, 4, shuffle=False)
    shards.set_world(0, 2)
    steps = []
    while shards.epoch == 0:
        steps.append(shards.pieces())
        shards.advance()
    # Each step continues each rank's lease where the previous step ended.
    firsts = [[mine[0] for mine in step] for step in steps[:10]]
    assert [f[0] for f in firsts] == [(0, 4 * i, 4 * i + 4) for i in range(10)]
    assert [f[1] for f in firsts] == [(1, 4 * i, 4 * i + 4) for i in range(10)]


def test_a_resize_hands_the_leases_of_ranks_that_left_to_the_next_takers() -> None:
    shards = ElasticShards([10, 10, 10], 2, shuffle=False)
    shards.set_world(0, 3)
    shards.advance()
    assert shards.pieces() == [[(0, 2, 4)], [(1, 2, 4)], [(2, 2, 4)]]
    shards.set_world(0, 2)
    # Rank 2's shard goes back to the queue: whoever runs out first continues it.
    assert shards.leases.returned == [(2, 2, 10)]
    assert shards.pieces() == [[(0, 2, 4)], [(1, 2, 4)]]


def test_a_rank_left_without_shards_splits_the_largest_lease() -> None:
    shards = ElasticShards([3, 12], 2, shuffle=False)
    shards.set_world(0, 2)
    shards.advance()  # rank 0: shard 0 [0, 2); rank 1: shard 1 [0, 2)
    shards.advance()  # rank 0: shard 0 [2, 3) then half of shard 1's rest
    assert shards.leases.held == [(1, 8, 12), (1, 4, 7)]
    assert shards.remaining == 7


def test_global_ids_name_shard_and_position() -> None:
    shards = ElasticShards([3, 0, 5], 2)
    assert shards.ids([(2, 1, 3), (0, 0, 1)]) == [4, 5, 0]
    assert [shards.locate(i) for i in (0, 2, 3, 7)] == [(0, 0), (0, 2), (2, 0), (2, 4)]
    with pytest.raises(IndexError):
        shards.locate(8)


def test_state_for_other_shards_or_from_a_plain_sampler_is_refused() -> None:
    state = ElasticShards([4, 4], 2).state_dict()
    with pytest.raises(ValueError, match="shards changed"):
        ElasticShards([5, 3], 2).load_state_dict(state)
    plain = {k: v for k, v in state.items() if k != "shards"}
    with pytest.raises(ValueError, match="ElasticSampler, not ElasticShards"):
        ElasticShards([4, 4], 2).load_state_dict(plain)
    with pytest.raises(ValueError, match="negative"):
        ElasticShards([4, -1], 2)


def test_the_loader_reads_the_committed_cursor_and_stale_iterations_fail() -> None:
    sizes = [5, 7]
    shards = ElasticShards(sizes, 3, seed=2)
    shards.set_world(1, 2)

    def read(shard: int, start: int, stop: int) -> list[int]:
        return [shards.starts[shard] + i for i in range(start, stop)]

    loader = shards.loader(read, collate_fn=list)
    assert list(loader) == list(shards), "the loader and the batch sampler agree"
    committed = shards.state_dict()
    batches = iter(loader)
    first = next(batches)
    shards.advance()
    shards.load_state_dict(committed)
    with pytest.raises(StaleIterator):
        next(batches)
    assert next(iter(loader)) == first, "a new iteration starts at the commit"


def test_a_state_whose_leases_lost_samples_stops_instead_of_training_empty_steps() -> None:
    shards = ElasticShards([4, 4], 2, shuffle=False)
    shards.set_world(0, 2)
    shards.advance()
    broken = shards.state_dict()
    broken["shards"]["held"] = [None, None]
    broken["shards"]["next_shard"] = 2
    shards.load_state_dict(broken)
    with pytest.raises(RuntimeError, match="4 samples left in epoch 0"):
        shards.advance()
