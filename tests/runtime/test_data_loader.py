"""Leased shards through DataLoaders with four persistent worker processes per rank:
the workers prepare steps ahead of training, and after a rollback or a resize each
loader starts again from the committed leases, whatever its workers had prepared.

The ranks live in this process (one ElasticShards and one loader each), stepping
together as a world would; ``read`` returns global ids, so what is counted is what each
rank's loader delivered.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from ringwright.runtime.data import ElasticShards, ShardLoader
from tests.waiting import wait_for

SIZES = [23, 0, 9, 41, 17, 30]
BATCH = 3
WORKERS = 4

pytestmark = pytest.mark.timeout(300)


@dataclass
class Rank:
    shards: ElasticShards
    loader: ShardLoader[int]
    batches: Iterator[Any] | None = None
    """The current iteration (a new one after every rollback, resize or epoch end)."""
    delivered: int = 0


@dataclass
class World:
    ranks: list[Rank] = field(default_factory=list)
    snapshot: dict[str, Any] = field(default_factory=dict)
    pending: list[tuple[int, list[int]]] = field(default_factory=list)
    committed: dict[int, Counter[int]] = field(default_factory=lambda: defaultdict(Counter))
    prepared: torch.Tensor = field(
        default_factory=lambda: torch.zeros(1, dtype=torch.int64).share_memory_())  # type: ignore[no-untyped-call]
    """Steps the loaders' workers have read, counted in shared memory."""

    def collate(self, samples: list[int]) -> list[int]:
        """Runs in a loader worker, once per step it prepares."""
        self.prepared += 1
        return samples

    def delivered(self) -> int:
        return sum(r.delivered for r in self.ranks)

    def resize(self, size: int) -> None:
        """A new world of ``size`` from the last commit: survivors keep their loader
        (and its workers), newcomers make theirs."""
        while len(self.ranks) < size:
            shards = ElasticShards(SIZES, BATCH, seed=11)

            def read(shard: int, start: int, stop: int, s: ElasticShards = shards) -> range:
                return range(s.starts[shard] + start, s.starts[shard] + stop)

            loader = shards.loader(read, collate_fn=self.collate, num_workers=WORKERS,
                                   persistent_workers=True, prefetch_factor=2)
            self.ranks.append(Rank(shards, loader))
        del self.ranks[size:]
        for rank, r in enumerate(self.ranks):
            if self.snapshot:
                r.shards.load_state_dict(dict(self.snapshot))
            r.shards.set_world(rank, size)
            r.batches = None

    def step(self) -> bool:
        """One step on every rank; False at the end of the epoch (iterations restart)."""
        epoch = self.ranks[0].shards.epoch
        shares: list[list[int]] = []
        for r in self.ranks:
            if r.batches is None:
                r.batches = iter(r.loader)
            share = next(r.batches, None)
            if share is None:
                assert not shares, "ranks ended the epoch on different steps"
                for rr in self.ranks:
                    rr.batches = None
                return False
            shares.append(share)
            r.delivered += 1
        for r in self.ranks:
            r.shards.advance()
        self.pending.append((epoch, [i for share in shares for i in share]))
        return True

    def commit(self) -> None:
        for epoch, ids in self.pending:
            self.committed[epoch].update(ids)
        self.pending.clear()
        self.snapshot = self.ranks[0].shards.state_dict()

    def train(self, steps: int) -> None:
        for _ in range(steps):
            if not self.step():
                self.step()


def test_four_worker_loaders_resume_exactly_across_rollbacks_and_resizes() -> None:
    world = World()
    world.resize(2)
    world.commit()
    world.train(5)
    world.commit()
    world.train(3)
    # The loaders' workers prepare steps beyond those trained: the rollback drops them.
    wait_for(lambda: int(world.prepared) > world.delivered(), "workers to prefetch steps")
    world.pending.clear()
    world.resize(2)  # a rollback: same world, from the commit
    world.train(4)
    world.commit()
    world.resize(3)  # a planned resize at a commit
    world.train(6)
    world.pending.clear()
    world.resize(2)  # a member died: roll back and go on with two
    epoch = 2
    while world.ranks[0].shards.epoch < epoch:
        world.train(1)
    world.commit()
    assert sorted(world.committed) == list(range(epoch))
    for e, counts in world.committed.items():
        assert counts == Counter(range(sum(SIZES))), f"epoch {e}: {counts}"
        repeated = {i: n for i, n in counts.items() if n > 1}
        assert not repeated, f"epoch {e}: trained twice {repeated}"
