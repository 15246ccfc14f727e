"""A keyed permutation of ``[0, n)`` computed one position at a time, in O(1) memory.

An epoch's order over a billion samples cannot be a shuffled list (tens of gigabytes,
and a shuffle of the whole dataset before the first step). Instead ``order[i]`` is
computed on demand: a Feistel network permutes the ``m``-bit integers, where ``2**m``
is the next power of two at or above ``n``, and *cycle walking* maps it onto ``[0, n)``:
applying the network again while the result is ``n`` or more stays on the cycle of
``i``, which holds ``i`` itself, so it ends inside the range and the map is a bijection.
Since ``2**m < 2n``, fewer than two applications are needed on average.

Each round splits the ``m`` bits into a high and a low part, mixes a keyed hash of the
low part into the high part (invertible, whatever the hash) and rotates the two parts,
so the widths alternate and ``m`` need not be even. The keys come from a
cryptographic hash of a label, so every process derives the same permutation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np

ROUNDS = 6
"""Four rounds of a good round function make a pseudo-random permutation (Luby-Rackoff);
two more because this round function is a cheap multiplicative hash."""

_ARRAY_FROM = 48
"""Batches at least this long go through numpy: below, its per-call overhead dominates."""
_MASK64 = (1 << 64) - 1
_MULTIPLIER = 0x9E3779B97F4A7C15
"""An odd 64-bit constant (2**64 over the golden ratio): spreads the low bits upwards."""


class Permutation(Sequence[int]):
    """A bijection on ``[0, n)`` determined by ``n`` and ``label``; ``p[i]`` costs O(1).

    Equal labels give equal permutations in every process; ``list(p)`` materialises it
    (for small ``n`` only).
    """

    def __init__(self, n: int, label: str) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs at least one element, got {n}")
        self.n = n
        self.label = label
        bits = max(2, (n - 1).bit_length())
        digest = hashlib.blake2b(label.encode(), digest_size=8 * ROUNDS).digest()
        keys = [int.from_bytes(digest[8 * r:8 * r + 8], "little") for r in range(ROUNDS)]
        rounds = []
        low = bits // 2
        for key in keys:
            high = bits - low
            # key; width and mask of the low part; shift keeping `high` hash bits; `high`
            rounds.append((key, low, (1 << low) - 1, 64 - high, high))
            low = high
        self._rounds = tuple(rounds)
        self._array_rounds = tuple(tuple(np.uint64(v) for v in r) for r in rounds)
        self._multiplier = np.uint64(_MULTIPLIER)

    def _mix(self, x: int) -> int:
        """One pass of the Feistel network over the ``m``-bit integers."""
        for key, low_bits, low_mask, shift, high_bits in self._rounds:
            low = x & low_mask
            high = (x >> low_bits) ^ ((((low ^ key) * _MULTIPLIER) & _MASK64) >> shift)
            x = (low << high_bits) | high
        return x

    def _at(self, i: int) -> int:
        n = self.n
        x = self._mix(i)
        while x >= n:
            x = self._mix(x)
        return x

    def _mix_array(self, x: np.ndarray) -> np.ndarray:
        """:meth:`_mix` on every element of a ``uint64`` array (products wrap mod 2**64)."""
        multiplier = self._multiplier
        for key, low_bits, low_mask, shift, high_bits in self._array_rounds:
            low = x & low_mask
            x = (low << high_bits) | ((x >> low_bits) ^ (((low ^ key) * multiplier) >> shift))
        return x

    def take(self, positions: range) -> list[int]:
        """``[self[p] for p in positions]`` for in-range positions. Beyond a few dozen
        they are computed all at once: a few dozen array operations, not a loop per index."""
        if len(positions) < _ARRAY_FROM:
            return [self._at(p) for p in positions]
        values: list[int] = self.take_array(
            np.arange(positions.start, positions.stop, positions.step, dtype=np.uint64)
        ).tolist()
        return values

    def take_array(self, positions: np.ndarray) -> np.ndarray:
        """``self[p]`` for every in-range position of a ``uint64`` array, at once."""
        x = self._mix_array(positions)
        outside = np.flatnonzero(x >= self.n)
        while outside.size:
            x[outside] = self._mix_array(x[outside])
            outside = outside[x[outside] >= self.n]
        return x

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return self.take(range(*index.indices(self.n)))
        if index < 0:
            index += self.n
        if not 0 <= index < self.n:
            raise IndexError(f"position {index} outside a permutation of {self.n}")
        return self._at(index)

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return (self._at(i) for i in range(self.n))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Permutation):
            return (self.n, self.label) == (other.n, other.label)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.n, self.label))

    def __repr__(self) -> str:
        return f"Permutation({self.n}, {self.label!r})"
