"""A pure partitioner: which parameter server holds which piece of which tensor.

Dense tensors are cut into contiguous element ranges and embedding tables into hashed
row buckets (hashing spreads hot ids, so buckets have equal expected access load, not
only equal bytes). All pieces are then packed largest-first onto the servers, each onto
the least loaded one. Pieces are cut no larger than ``granularity`` of a server's fair
share, so the packing's max/mean load stays within ``1 + granularity`` (the classic
largest-first bound: max <= mean + largest piece).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt

HASH_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)
"""Fibonacci hashing: consecutive ids land in unrelated buckets."""
COUNT_BLOCK = 1 << 20
"""Row ids hashed at a time when counting a table's rows per bucket."""


class Kind(StrEnum):
    DENSE = "dense"
    EMBEDDING = "embedding"


@dataclass(frozen=True)
class TensorSpec:
    """A parameter to place: dense (any shape) or an embedding table (rows x dim)."""

    name: str
    shape: tuple[int, ...]
    itemsize: int = 4
    kind: Kind = Kind.DENSE
    init_std: float | None = None
    """Embedding tables only: when set, the servers create each row on its first use,
    drawn from N(0, init_std²) by the row's id (see ``serving.shard.initial_rows``), and
    no worker ever holds the whole table; when None, the first worker sends every row."""

    @property
    def lazy(self) -> bool:
        """Rows are created by the servers on first use (``init_std`` is set)."""
        return self.kind is Kind.EMBEDDING and self.init_std is not None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_numel(self) -> int:
        """Elements per embedding row (the whole tensor for a dense one)."""
        return math.prod(self.shape[1:]) if self.kind is Kind.EMBEDDING else self.numel

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class DenseSlice:
    """Elements ``[start, stop)`` of a dense tensor, flattened, on ``shard``."""

    name: str
    start: int
    stop: int
    shard: int


@dataclass(frozen=True)
class Piece:
    """One unit of packing: a dense slice or one hashed bucket of an embedding table."""

    name: str
    kind: Kind
    start: int
    """Dense: first element. Embedding: the bucket number."""
    stop: int
    """Dense: one past the last element. Embedding: the bucket number + 1."""
    nbytes: int


@dataclass(frozen=True)
class Partition:
    """Where every parameter lives; also what the PS and the workers agree on."""

    shards: int
    specs: tuple[TensorSpec, ...]
    dense: tuple[DenseSlice, ...]
    buckets: dict[str, tuple[int, ...]]
    """Per embedding table: the shard of each hashed bucket."""
    loads: tuple[int, ...]
    """Bytes held by each shard."""

    @property
    def imbalance(self) -> float:
        """max/mean of the shards' loads (1.0 is perfect)."""
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean if mean else 1.0

    def spec(self, name: str) -> TensorSpec:
        for s in self.specs:
            if s.name == name:
                return s
        raise KeyError(name)

    def dense_on(self, shard: int) -> list[DenseSlice]:
        """The dense slices ``shard`` holds, in a stable order."""
        return [d for d in self.dense if d.shard == shard]

    def row_shards(self, name: str, rows: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The shard of each embedding row id in ``rows``."""
        owners = np.asarray(self.buckets[name], dtype=np.int64)
        picked: npt.NDArray[np.int64] = owners[bucket_of(rows, len(owners))]
        return picked

    def rows_asked(self, name: str, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Rows of table ``name`` a pull of ``ids`` asks each shard for: its unique ids
        (a client asks for a row once however often the batch uses it), by shard."""
        shards: npt.NDArray[np.int64] = np.bincount(self.row_shards(name, np.unique(ids)),
                                                    minlength=self.shards)
        return shards

    def rows_on(self, name: str, shard: int) -> npt.NDArray[np.int64]:
        """All row ids of table ``name`` that ``shard`` holds, ascending."""
        rows = np.arange(self.spec(name).shape[0], dtype=np.int64)
        held: npt.NDArray[np.int64] = rows[self.row_shards(name, rows) == shard]
        return held


def bucket_of(rows: npt.NDArray[np.int64], buckets: int) -> npt.NDArray[np.int64]:
    """The hashed bucket of each row id."""
    mixed = rows.astype(np.uint64) * HASH_MULTIPLIER  # wraps mod 2**64 by design
    return ((mixed >> np.uint64(32)) % np.uint64(buckets)).astype(np.int64)


def partition(specs: Sequence[TensorSpec], shards: int, *,
              granularity: float = 0.02, buckets_per_shard: int = 64,
              min_piece_bytes: int = 1 << 16) -> Partition:
    """Place ``specs`` on ``shards`` servers with balanced bytes (see the module doc).

    Dense pieces are never cut below ``min_piece_bytes``: a small model stays in few
    messages, at the price of balance that only large models need."""
    if shards < 1:
        raise ValueError(f"need at least one shard, got {shards}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("tensor names must be unique")
    total = sum(s.nbytes for s in specs)
    cap = max(1, min_piece_bytes, int(granularity * total / shards))
    pieces: list[Piece] = []
    for spec in specs:
        pieces.extend(_cut(spec, cap, shards * buckets_per_shard))
    for spec in specs:
        if spec.kind is Kind.EMBEDDING and spec.shape[0] == 0:
            raise ValueError(f"embedding {spec.name} has no rows")
    # Largest first onto the least loaded shard; ties broken by index for determinism.
    pieces.sort(key=lambda p: (-p.nbytes, p.name, p.start))
    heap = [(0, i) for i in range(shards)]
    loads = [0] * shards
    dense: list[DenseSlice] = []
    buckets: dict[str, list[int]] = {}
    for piece in pieces:
        if piece.kind is Kind.EMBEDDING:
            buckets.setdefault(piece.name, []).append(0)
    for piece in pieces:
        load, shard = heapq.heappop(heap)
        loads[shard] = load + piece.nbytes
        heapq.heappush(heap, (loads[shard], shard))
        if piece.kind is Kind.DENSE:
            dense.append(DenseSlice(piece.name, piece.start, piece.stop, shard))
        else:
            buckets[piece.name][piece.start] = shard
    dense.sort(key=lambda d: (d.name, d.start))
    return Partition(shards, tuple(specs), tuple(dense),
                     {k: tuple(v) for k, v in buckets.items()}, tuple(loads))


def _bucket_count(spec: TensorSpec, wanted: int) -> int:
    return max(1, min(wanted, spec.shape[0]))


def _cut(spec: TensorSpec, cap: int, wanted_buckets: int) -> list[Piece]:
    if spec.kind is Kind.EMBEDDING:
        if len(spec.shape) != 2:
            raise ValueError(f"embedding {spec.name} must be rows x dim, got {spec.shape}")
        # Enough buckets that none exceeds the cap (as far as rows allow).
        count = _bucket_count(spec, max(wanted_buckets, math.ceil(spec.nbytes / cap)))
        rows = np.zeros(count, dtype=np.int64)
        # In blocks: hashing every id of a table of 10^7 rows at once takes ~300 MB.
        for start in range(0, spec.shape[0], COUNT_BLOCK):
            block = np.arange(start, min(start + COUNT_BLOCK, spec.shape[0]), dtype=np.int64)
            rows += np.bincount(bucket_of(block, count), minlength=count)
        row_bytes = spec.row_numel * spec.itemsize
        return [Piece(spec.name, Kind.EMBEDDING, b, b + 1, int(n) * row_bytes)
                for b, n in enumerate(rows)]
    per_piece = max(1, cap // spec.itemsize)
    count = max(1, math.ceil(spec.numel / per_piece))
    # Equal cuts rather than cap-sized ones plus a remainder.
    bounds = [spec.numel * i // count for i in range(count + 1)]
    return [Piece(spec.name, Kind.DENSE, a, b, (b - a) * spec.itemsize)
            for a, b in itertools.pairwise(bounds) if b > a]
