"""Initial values of a server-initialized table's rows, computed from the row ids alone.

Every server that creates a row (its primary, a replica replaying the journal, a server
restoring it) must create the same values, whenever and in whatever order it is first
used, without any of them holding the whole table. So each element is a pure function
of (table, row, column): a counter-based generator (SplitMix64 of the element's index,
keyed by the table's name) gives two uniforms, and the Box-Muller transform a normal.
"""

from __future__ import annotations

import hashlib

import numpy as np
import numpy.typing as npt
import torch

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """SplitMix64's finalizer: every input bit flips about half the output bits."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1  # wraps mod 2**64 by design
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    out: npt.NDArray[np.uint64] = z ^ (z >> np.uint64(31))
    return out


def _uniform(counters: npt.NDArray[np.uint64], key: np.uint64) -> npt.NDArray[np.float64]:
    """A uniform in (0, 1] per counter: the top 53 bits of its mixed value."""
    bits = _mix((counters ^ key) + _GAMMA) >> np.uint64(11)
    out: npt.NDArray[np.float64] = (bits.astype(np.float64) + 1.0) * 2.0 ** -53
    return out


def table_key(table: str) -> np.uint64:
    """A 64-bit key for ``table`` that is the same in every process (not ``hash()``)."""
    return np.uint64(int.from_bytes(hashlib.blake2b(table.encode(), digest_size=8).digest(),
                                    "little"))


def initial_rows(table: str, ids: torch.Tensor, dim: int, std: float) -> torch.Tensor:
    """Rows ``ids`` (int64) of ``table``, ``len(ids) x dim`` float32 drawn from N(0, std²)."""
    rows = ids.numpy().astype(np.uint64)
    cols = np.arange(dim, dtype=np.uint64)
    element = rows[:, None] * np.uint64(dim) + cols[None, :]
    key = table_key(table)
    u1 = _uniform(element * np.uint64(2), key)
    u2 = _uniform(element * np.uint64(2) + np.uint64(1), key)
    normal = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
    return torch.from_numpy((normal * std).astype(np.float32))
