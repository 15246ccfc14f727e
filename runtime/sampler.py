"""An elastic sampler: one global order per epoch and one cursor shared by all ranks.

Every rank computes the same permutation of the dataset for an epoch (seeded by the
sampler's seed and the epoch number). Training consumes it one *global batch* at a
time: ``world size x batch size`` positions, split between the ranks. The only
mutable state is ``(epoch, offset)``; it is committed, rolled back and broadcast with
the rest of the training state. After a resize the rest of the epoch,
``order[offset:]``, is simply split over the new world, so counting from the last
commit no sample is lost and none is repeated within an epoch.

The order is a keyed permutation computed position by position
(:class:`~ringwright.runtime.permutation.Permutation`): memory and the cost of a
batch do not grow with the dataset, so a billion samples work like a thousand.

The sampler is also a torch batch sampler: ``DataLoader(dataset, batch_sampler=sampler,
num_workers=N)`` loads this rank's share of each global batch, from the cursor to the
end of the epoch. The loader runs ahead of training (it prefetches
``prefetch_factor * num_workers`` batches), so iterating never moves the cursor: the
training loop does, through ``State.advance()``, once per trained batch. A rollback or
a world change ends the training function; when the runtime calls it again, iterating
the loader anew starts from the committed cursor, and the loader discards what its
workers had prefetched. An iterator that outlives a rollback or a world change stops
with :class:`StaleIterator` rather than hand out batches of a cursor that is gone.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from .permutation import Permutation

_CHUNK_INDICES = 4096
"""An iterator computes the indices of up to this many samples' batches at once."""
_CHUNK_FROM = 64
"""Fewer indices than this are computed one by one (array passes cost more)."""


class StaleIterator(RuntimeError):
    """A data-loader iterator created before a rollback or world change was used after it."""


class ElasticSampler(Sampler[list[int]]):
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
        self._order: Sequence[int] = range(num_samples)
        self._order_key: tuple[int, int, bool] | None = None
        """(seed, epoch, shuffle) that :attr:`_order` was made for."""
        self._resets = 0
        """Counts rollbacks, syncs and world changes: an iterator made before one is stale."""

    def set_world(self, rank: int, size: int) -> None:
        """Follow a new world: the rest of the epoch is split over ``size`` ranks."""
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside a world of size {size}")
        self.rank = rank
        self.size = size
        self._resets += 1

    def order(self) -> Sequence[int]:
        """This epoch's order of sample indices (identical on every rank), computed
        position by position: a :class:`Permutation` seeded by (seed, epoch), or the
        identity without shuffling."""
        key = (self.seed, self.epoch, self.shuffle)
        if self._order_key != key:
            self._order = (Permutation(self.num_samples,
                                       f"ringwright-sampler:{self.seed}:{self.epoch}")
                           if self.shuffle else range(self.num_samples))
            self._order_key = key
        return self._order

    def global_positions(self) -> range:
        """Positions in :meth:`order` that the next global batch covers."""
        return self._positions_at(self.offset)

    def batch(self) -> list[int]:
        """This rank's sample indices for the next step. At the epoch's end a share may be
        short, or a few samples longer: a tail of fewer samples than ranks is spread
        over the last full batch, so that no rank gets an empty batch (unless fewer
        samples than ranks are left in the whole epoch, after a late resize)."""
        return self._share_of(self.global_positions())

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's share of every global batch from the cursor to the end of the
        epoch, for a ``DataLoader``'s ``batch_sampler``; the cursor itself stays put.

        Raises :class:`StaleIterator` when asked for a batch after a rollback, a sync or
        a world change: iterate the loader again (``for batch in loader`` inside the
        training function) to continue from the committed cursor.
        """
        # Taken now, not at the first next(): the cursor is the one iter() was called at.
        return self._batches_from(self.offset, self._resets)

    def _batches_from(self, position: int, resets: int) -> Iterator[list[int]]:
        chunk = 1
        while position < self.num_samples:
            # The shares of several batches are computed together (one pass of array
            # operations): a loader asks for batch after batch, and per batch the
            # passes' fixed cost would dominate. Doubling keeps the first batch quick.
            shares: list[range] = []
            while position < self.num_samples and len(shares) < chunk:
                positions = self._positions_at(position)
                start, count = _share(len(positions), self.size, self.rank)
                shares.append(positions[start:start + count])
                position = positions.stop
            chunk = min(2 * chunk, max(1, _CHUNK_INDICES // self.batch_size))
            for batch in self._take(shares):
                if self._resets != resets:
                    raise StaleIterator(
                        "this data-loader iterator predates a rollback or a world change: "
                        "iterate the loader again (for batch in loader) inside the "
                        "training function; it continues from the committed position")
                yield batch

    def _take(self, shares: list[range]) -> list[list[int]]:
        """The sample indices at each range of positions of this epoch's order."""
        order = self.order()
        if not isinstance(order, Permutation) or sum(map(len, shares)) < _CHUNK_FROM:
            return [self._indices(share) for share in shares]
        taken: list[int] = order.take_array(np.concatenate(
            [np.arange(r.start, r.stop, dtype=np.uint64) for r in shares])).tolist()
        bounds = [0, *itertools.accumulate(map(len, shares))]
        return [taken[a:b] for a, b in itertools.pairwise(bounds)]

    def __len__(self) -> int:
        """Steps left in this epoch (what ``len(loader)`` reports)."""
        full, tail = divmod(self.remaining, self.size * self.batch_size)
        return full + (1 if tail and (tail >= self.size or not full) else 0)

    def _positions_at(self, offset: int) -> range:
        stop = offset + self.size * self.batch_size
        # A last global batch of fewer samples than ranks would leave a rank an empty
        # batch, which a DataLoader cannot collate: such a tail joins the batch before.
        if self.num_samples - stop < self.size:
            stop = self.num_samples
        return range(offset, stop)

    def _share_of(self, positions: range) -> list[int]:
        start, count = _share(len(positions), self.size, self.rank)
        return self._indices(positions[start:start + count])

    def _indices(self, positions: range) -> list[int]:
        order = self.order()
        if isinstance(order, Permutation):
            return order.take(positions)
        return [order[p] for p in positions]

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
        self._resets += 1


def _share(total: int, size: int, rank: int) -> tuple[int, int]:
    """Start and length of ``rank``'s contiguous share of ``total`` items."""
    base, extra = divmod(total, size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)
