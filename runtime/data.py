"""Sharded data, leased to ranks: an ``IterableDataset`` path with exact accounting.

Data kept in shards (files, objects, record files) is best read one shard at a time,
from the front: :class:`ElasticShards` leases each rank a shard, and the rank reads
the next ``batch_size`` samples of its lease at every step; when the lease runs out it
takes the next shard of the epoch's order. When every shard has been handed out, a
rank left without work takes the second half of the largest lease still being read,
so the epoch ends with every rank busy rather than one rank reading a long shard alone.

The leases are not negotiated: every rank computes every rank's leases from the same
state, the world size and the step, so ``advance()`` moves all of them on every rank
without a message. That state (epoch, how far each lease got, the ranges handed back)
is small, and :class:`ElasticShards` is an :class:`~ringwright.runtime.sampler.ElasticSampler`:
``State(model, optimizer, shards)`` commits, broadcasts and rolls it back with the
model. After a rollback every lease continues from its committed position; after a
resize the leases of ranks that are gone go back to the front of the queue. Counting
from the commits, every sample of every shard is trained exactly once per epoch.

Samples are named by *global ids*: shard ``s``'s sample ``i`` is ``start(s) + i``,
where ``start(s)`` is the number of samples in the shards before ``s``.

Two ways to load:

* ``shards.loader(read, num_workers=N, persistent_workers=True)``: a ``DataLoader`` over
  an ``IterableDataset`` whose workers call ``read(shard, start, stop)`` for the pieces
  of their steps (worker ``w`` of ``N`` prepares steps ``w``, ``w + N``, ...: the loader
  hands them out in step order);
* ``DataLoader(dataset, batch_sampler=shards, ...)`` with a map-style dataset indexed
  by global ids, like :class:`~ringwright.runtime.sampler.ElasticSampler`.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import pickle
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

from .permutation import Permutation
from .sampler import ElasticSampler, StaleIterator

T = TypeVar("T")

Piece = tuple[int, int, int]
"""``(shard, start, stop)``: samples ``start`` to ``stop - 1`` of one shard."""

CURSOR_BYTES = 1 << 20
"""Room for the cursor the loader's workers read (a few dozen bytes per live lease)."""


@dataclass
class Leases:
    """Where an epoch's reading stands: identical on every rank."""

    next_shard: int = 0
    """Position in the epoch's shard order of the first shard never leased."""
    returned: list[Piece] = field(default_factory=list)
    """Unread rest of leases given back (by ranks that left), leased before new shards."""
    held: list[Piece | None] = field(default_factory=list)
    """Each rank's lease, by rank; a list longer or shorter than the world is fitted
    to it (:meth:`fit`) before the next step."""

    def copy(self) -> Leases:
        """An independent copy (pieces are tuples, the lists are new)."""
        return Leases(self.next_shard, list(self.returned), list(self.held))

    def fit(self, size: int) -> None:
        """Fit the leases to ``size`` ranks: leases of ranks beyond it go back to the
        front of the queue, in rank order; new ranks start without one."""
        gone = [p for p in self.held[size:] if p is not None]
        self.returned[:0] = gone
        del self.held[size:]
        self.held.extend([None] * (size - len(self.held)))

    def step(self, size: int, batch_size: int, order: Sequence[int],
             sizes: Sequence[int]) -> list[list[Piece]]:
        """Move every rank ``batch_size`` samples on (fewer at the epoch's very end),
        in rank order; returns each rank's pieces for this step."""
        self.fit(size)
        taken: list[list[Piece]] = []
        for rank in range(size):
            mine: list[Piece] = []
            need = batch_size
            while need:
                lease = self.held[rank] or self._lease(order, sizes)
                if lease is None:
                    break
                shard, start, stop = lease
                n = min(need, stop - start)
                mine.append((shard, start, start + n))
                need -= n
                self.held[rank] = (shard, start + n, stop) if start + n < stop else None
            taken.append(mine)
        return taken

    def _lease(self, order: Sequence[int], sizes: Sequence[int]) -> Piece | None:
        """A new lease: a returned piece, else the next shard, else the
        second half of the largest lease (never a lease with one sample left)."""
        if self.returned:
            return self.returned.pop(0)
        while self.next_shard < len(order):
            shard = order[self.next_shard]
            self.next_shard += 1
            if sizes[shard]:
                return (shard, 0, sizes[shard])
        left, holder = max(((p[2] - p[1], r) for r, p in enumerate(self.held) if p is not None),
                           default=(0, -1), key=lambda lr: (lr[0], -lr[1]))
        if left < 2:
            return None
        shard, start, stop = self.held[holder]  # type: ignore[misc]
        middle = start + (left + 1) // 2
        self.held[holder] = (shard, start, middle)
        return (shard, middle, stop)


class ElasticShards(ElasticSampler):
    """Leases shards of ``sizes[s]`` samples to the ranks; an elastic sampler whose
    batches are each rank's next ``batch_size`` samples of its leases, as global ids.

    ``seed`` and ``shuffle`` order the shards per epoch (the samples inside a shard are
    read in their order). Pass it to :class:`~ringwright.runtime.state.State` as the
    sampler; call :meth:`loader` for a ``DataLoader``.
    """

    def __init__(self, sizes: Sequence[int], batch_size: int, *, seed: int = 0,
                 shuffle: bool = True) -> None:
        if not sizes:
            raise ValueError("ElasticShards needs at least one shard")
        bad = [(s, n) for s, n in enumerate(sizes) if n < 0]
        if bad:
            raise ValueError(f"shard sizes must not be negative: (shard, size) {bad[:5]}")
        super().__init__(sum(sizes), batch_size, seed=seed, shuffle=shuffle)
        self.sizes = [int(n) for n in sizes]
        self.starts = [0, *itertools.accumulate(self.sizes)]
        """Global id of each shard's first sample (and the total, last)."""
        self.leases = Leases()
        self._cursor: torch.Tensor | None = None
        """The cursor, pickled, for the loader's worker processes (shared memory, made
        by the first :meth:`publish`, before the loader starts its workers)."""

    # What the elastic sampler's users call.

    def set_world(self, rank: int, size: int) -> None:
        """Follow a new world: leases of ranks beyond ``size`` go back to the queue."""
        super().set_world(rank, size)
        self.leases.fit(size)

    def order(self) -> Sequence[int]:
        """This epoch's order of *shards* (identical on every rank)."""
        key = (self.seed, self.epoch, self.shuffle)
        if self._order_key != key:
            self._order = shard_order(len(self.sizes), self.seed, self.epoch, self.shuffle)
            self._order_key = key
        return self._order

    def pieces(self) -> list[list[Piece]]:
        """Every rank's pieces for the next step (the cursor stays put)."""
        return self.leases.copy().step(self.size, self.batch_size, self.order(), self.sizes)

    def global_positions(self) -> range:
        """Positions in the epoch (samples consumed) that the next step covers."""
        count = sum(stop - start for mine in self.pieces() for _, start, stop in mine)
        return range(self.offset, self.offset + count)

    def batch(self) -> list[int]:
        """This rank's global ids for the next step (few or none at the epoch's end)."""
        return self.ids(self.pieces()[self.rank])

    def ids(self, pieces: Iterable[Piece]) -> list[int]:
        """Global ids of the samples in ``pieces``."""
        return [i for shard, start, stop in pieces
                for i in range(self.starts[shard] + start, self.starts[shard] + stop)]

    def locate(self, global_id: int) -> tuple[int, int]:
        """``(shard, index in the shard)`` of a global id."""
        if not 0 <= global_id < self.num_samples:
            raise IndexError(f"sample {global_id} outside {self.num_samples} samples")
        shard = bisect.bisect_right(self.starts, global_id) - 1
        return shard, global_id - self.starts[shard]

    def advance(self) -> None:
        """Record that every rank finished the current step."""
        taken = self.leases.step(self.size, self.batch_size, self.order(), self.sizes)
        count = sum(stop - start for mine in taken for _, start, stop in mine)
        if not count:
            # Else training would go on with empty batches and never end the epoch.
            raise RuntimeError(
                f"the shard leases cover none of the {self.remaining} samples left in "
                f"epoch {self.epoch}: this sampler state is inconsistent; resume from an "
                "earlier checkpoint")
        self.offset += count
        if self.offset >= self.num_samples:
            self.epoch += 1
            self.offset = 0
            self.leases = Leases()

    def __len__(self) -> int:
        """Steps left in this epoch."""
        return sum(1 for _ in self._steps(self._snapshot()))

    def _batches_from(self, position: int, resets: int) -> Iterator[list[int]]:
        del position  # the leases say where each rank is
        for pieces in self._steps(self._snapshot()):
            if self._resets != resets:
                raise StaleIterator(
                    "this data-loader iterator predates a rollback or a world change: "
                    "iterate the loader again (for batch in loader) inside the training "
                    "function; it continues from the committed position")
            yield self.ids(pieces)

    # The cursor and its state.

    def _snapshot(self) -> dict[str, Any]:
        return {"state": self.state_dict(), "rank": self.rank, "size": self.size}

    def _steps(self, snapshot: dict[str, Any]) -> Iterator[list[Piece]]:
        """This rank's pieces for every step from ``snapshot`` to the end of its epoch."""
        state, rank, size = snapshot["state"], snapshot["rank"], snapshot["size"]
        order = shard_order(len(self.sizes), state["seed"], state["epoch"], state["shuffle"])
        leases = leases_from(state["shards"])
        left = self.num_samples - state["offset"]
        while left > 0:
            taken = leases.step(size, state["batch_size"], order, self.sizes)
            left -= sum(stop - start for mine in taken for _, start, stop in mine)
            yield taken[rank]

    def publish(self) -> None:
        """Write the cursor where the loader's workers read it: :meth:`loader` does it
        each time the loader is iterated, before its workers start the iteration."""
        data = pickle.dumps(self._snapshot())
        if len(data) > CURSOR_BYTES:
            raise ValueError(f"the shard cursor needs {len(data)} bytes, more than the "
                             f"{CURSOR_BYTES} reserved: too many leases are live at once")
        if self._cursor is None:
            cursor = torch.zeros(CURSOR_BYTES + 8, dtype=torch.uint8)
            self._cursor = cursor.share_memory_()  # type: ignore[no-untyped-call]
        self._cursor[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._cursor[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")),
                                            dtype=torch.uint8)

    def published(self) -> dict[str, Any]:
        """The cursor last written by :meth:`publish` (read in a loader's worker)."""
        if self._cursor is None:
            return self._snapshot()
        length = int.from_bytes(self._cursor[:8].numpy().tobytes(), "little")
        loaded: dict[str, Any] = pickle.loads(self._cursor[8:8 + length].numpy().tobytes())
        return loaded

    def state_dict(self) -> dict[str, Any]:
        """The sampler's cursor plus the leases and the shard sizes."""
        state = super().state_dict()
        state["shards"] = {"next_shard": self.leases.next_shard,
                           "returned": [list(p) for p in self.leases.returned],
                           "held": [list(p) if p is not None else None
                                    for p in self.leases.held],
                           "sizes_digest": sizes_digest(self.sizes)}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt a committed or broadcast cursor; refuses one for other shards."""
        leases = state.get("shards")
        if leases is None:
            raise ValueError("this sampler state has no shard leases: it was saved by an "
                             "ElasticSampler, not ElasticShards")
        if leases["sizes_digest"] != sizes_digest(self.sizes):
            raise ValueError("the sampler state is for shards of other sizes: the dataset's "
                             "shards changed since it was saved")
        super().load_state_dict(state)
        self.leases = leases_from(leases)

    def loader(self, read: Callable[[int, int, int], Iterable[T]], *,
               collate_fn: Callable[[list[T]], Any] = default_collate,
               **loader_args: Any) -> ShardLoader[T]:
        """A ``DataLoader`` yielding this rank's collated batch for each step, from the
        cursor to the end of the epoch; ``read(shard, start, stop)`` returns those
        samples of a shard, in order. ``loader_args`` go to the ``DataLoader``
        (``num_workers``, ``persistent_workers``, ``pin_memory``...). A rank left with
        nothing at the epoch's very end gets an empty list, not a batch."""
        return ShardLoader(ShardStream(self, read, collate_fn), **loader_args)


def shard_order(count: int, seed: int, epoch: int, shuffle: bool) -> Sequence[int]:
    """The order in which an epoch leases ``count`` shards: a keyed permutation."""
    if not shuffle:
        return range(count)
    return Permutation(count, f"ringwright-shards:{seed}:{epoch}")


def leases_from(saved: dict[str, Any]) -> Leases:
    """The :class:`Leases` of a state dict's ``shards`` entry."""
    def piece(p: Sequence[int]) -> Piece:
        return (int(p[0]), int(p[1]), int(p[2]))

    return Leases(int(saved["next_shard"]), [piece(p) for p in saved["returned"]],
                  [piece(p) if p is not None else None for p in saved["held"]])


def sizes_digest(sizes: Sequence[int]) -> str:
    """A short digest of the shard sizes, to refuse a state saved for other shards."""
    return hashlib.blake2b(repr(list(sizes)).encode(), digest_size=8).hexdigest()


class ShardStream(IterableDataset[Any], Generic[T]):
    """The steps of one rank from the published cursor, read and collated; each of the
    loader's ``N`` workers prepares every ``N``-th step."""

    def __init__(self, shards: ElasticShards, read: Callable[[int, int, int], Iterable[T]],
                 collate_fn: Callable[[list[T]], Any]) -> None:
        self.shards = shards
        self.read = read
        self.collate_fn = collate_fn

    def __iter__(self) -> Iterator[Any]:
        # Not a generator: the cursor is read now, when the worker starts the iteration,
        # not at its first batch, by which time training may have moved on.
        steps = self.shards._steps(self.shards.published())
        info = get_worker_info()
        if info is not None:
            steps = itertools.islice(steps, info.id, None, info.num_workers)
        return (self._load(pieces) for pieces in steps)

    def _load(self, pieces: list[Piece]) -> Any:
        samples = [sample for shard, start, stop in pieces
                   for sample in self.read(shard, start, stop)]
        return self.collate_fn(samples) if samples else []


class ShardLoader(DataLoader[Any], Generic[T]):
    """A ``DataLoader`` over a :class:`ShardStream`; iterating it publishes the cursor
    first, and an iteration that outlives a rollback or a world change stops with
    :class:`~ringwright.runtime.sampler.StaleIterator`."""

    def __init__(self, dataset: ShardStream[T], **loader_args: Any) -> None:
        if loader_args.setdefault("batch_size", None) is not None:
            raise ValueError("ShardLoader batches by step itself: leave batch_size out")
        super().__init__(dataset, **loader_args)
        self.shards = dataset.shards

    # A generator, not the loader's iterator object: every batch is checked on its way out.
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        shards = self.shards
        shards.publish()
        resets = shards._resets
        for batch in super().__iter__():
            if shards._resets != resets:
                raise StaleIterator(
                    "this data-loader iterator predates a rollback or a world change: "
                    "iterate the loader again (for batch in loader) inside the training "
                    "function; it continues from the committed position")
            yield batch
