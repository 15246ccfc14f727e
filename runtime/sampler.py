"""An elastic sampler: one global order per epoch and one cursor shared by all ranks.

Every rank computes the same permutation of the dataset for an epoch (seeded by the
sampler's seed and the epoch number). Training consumes it one *global batch* at a
time: ``world size x batch size`` positions, split between the ranks. The only
mutable state is ``(epoch, offset)``; it is committed, rolled back and broadcast with
the rest of the training state. After a resize the rest of the epoch,
``order[offset:]``, is simply split over the new world, so counting from the last
commit no sample is lost and none is repeated within an epoch.
"""

from __future__ import annotations

import random
from typing import Any


class ElasticSampler:
    """Hands each rank its share of the next global batch of the current epoch."""

    def __init__(
        self, num_samples: int, batch_size: int, *, seed: int = 0, shuffle: bool = True
    ) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be at least 1, got {num_samples}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0
        """Positions of this epoch's order consumed by completed global batches."""
        self.rank = 0
        self.size = 1
        self._order_key: tuple[int, int, bool] | None = None
        """(seed, epoch, shuffle) that :attr:`_order` was drawn for."""
        self._order: list[int] = []

    def set_world(self, rank: int, size: int) -> None:
        """Follow a new world: the rest of the epoch is split over ``size`` ranks."""
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside a world of size {size}")
        self.rank = rank
        self.size = size

    def order(self) -> list[int]:
        """This epoch's order of sample indices (identical on every rank).

        Drawn once per (seed, epoch, shuffle): a rollback or a sync that lands in the same
        epoch keeps it, since drawing it again costs a shuffle of the whole dataset (a
        third of a second for 200,000 samples) before the first step of every recovery.
        """
        key = (self.seed, self.epoch, self.shuffle)
        if self._order_key != key:
            order = list(range(self.num_samples))
            if self.shuffle:
                random.Random(f"ringwright-sampler:{self.seed}:{self.epoch}").shuffle(order)
            self._order, self._order_key = order, key
        return self._order

    def global_positions(self) -> range:
        """Positions in :meth:`order` that the next global batch covers."""
        end = min(self.offset + self.size * self.batch_size, self.num_samples)
        return range(self.offset, end)

    def batch(self) -> list[int]:
        """This rank's sample indices for the next step (may be short at the epoch's end)."""
        positions = self.global_positions()
        start, count = _share(len(positions), self.size, self.rank)
        order = self.order()
        return [order[p] for p in positions[start:start + count]]

    def advance(self) -> None:
        """Record that every rank finished the current global batch."""
        self.offset = self.global_positions().stop
        if self.offset >= self.num_samples:
            self.epoch += 1
            self.offset = 0

    @property
    def remaining(self) -> int:
        """Samples of the current epoch not yet consumed."""
        return self.num_samples - self.offset

    def state_dict(self) -> dict[str, Any]:
        """What to commit and broadcast: the cursor and the parameters of the order."""
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt a committed or broadcast cursor; refuses one for a different dataset."""
        if int(state["num_samples"]) != self.num_samples:
            raise ValueError(
                f"sampler state is for {state['num_samples']} samples but this dataset "
                f"has {self.num_samples}"
            )
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self.seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])
        self.batch_size = int(state["batch_size"])


def _share(total: int, size: int, rank: int) -> tuple[int, int]:
    """Start and length of ``rank``'s contiguous share of ``total`` items."""
    base, extra = divmod(total, size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)
