"""Hierarchical all-reduce: inside each rack, across racks, back inside the rack.

A flat ring over N members takes 2(N-1) steps, and every step waits on the slowest
edge, so the oversubscribed, higher-latency spine is paid on each of them. Here the
buffer is cut into ``m`` shards (``m``: the size of the smallest rack). Shard ``j`` is
first reduced inside every rack onto the rack's ``j``-th member, then all-reduced
across racks among the ``j``-th members (one member per rack, ``m`` such rings in
parallel), then broadcast inside each rack from its ``j``-th member. The spine then
carries 2(R-1) steps of R racks instead of 2(N-1), and every rack, even or uneven,
takes part with all of its members.

:func:`rack_plan` decides from the world alone (the same answer on every rank);
:class:`RackGroups` holds the process groups of one epoch, built right after the
default group and destroyed with it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ringwright.world import HierarchicalAllReduce, World

PIECE_BYTES = 1 << 20
"""Pipeline granularity: a buffer goes through the three stages in pieces of this size."""
MAX_PIECES = 16


@dataclass(frozen=True)
class RackPlan:
    """Which ranks share a rack, and how many shards cross the spine."""

    racks: tuple[tuple[int, ...], ...]
    """Ranks of every rack, racks in ring order."""

    @property
    def shards(self) -> int:
        """Shards per buffer: one per member of the smallest rack."""
        return min(len(r) for r in self.racks)

    def rack_of(self, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s rack."""
        for rack in self.racks:
            if rank in rack:
                return rack
        raise ValueError(f"rank {rank} is in no rack of {self.racks}")

    def cross(self, shard: int) -> tuple[int, ...]:
        """The ranks that all-reduce ``shard`` across racks: its owner in every rack."""
        return tuple(rack[shard] for rack in self.racks)


def rack_plan(world: World) -> RackPlan | None:
    """The two-level plan for ``world``, or None where the flat ring is used.

    Auto goes hierarchical when the world spans several racks and at least one rack
    holds several members (with one member per rack both are the same ring).
    """
    mode = world.topology.hierarchical_all_reduce
    racks = world.racks()
    if mode is HierarchicalAllReduce.DISABLED or len(racks) < 2:
        return None
    if mode is HierarchicalAllReduce.AUTO and all(len(r) == 1 for r in racks):
        return None
    return RackPlan(racks)


def shard_bounds(numel: int, shards: int) -> list[tuple[int, int]]:
    """``shards`` contiguous (start, stop) ranges covering ``numel`` elements, sizes
    differing by at most one."""
    base, extra = divmod(numel, shards)
    bounds, start = [], 0
    for j in range(shards):
        stop = start + base + (1 if j < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


class RackGroups:
    """The rack and cross-rack process groups of one epoch, for one rank.

    The buffer goes through in pieces, as a pipeline of three stages with a process
    group each (reduce inside the rack, all-reduce across, broadcast inside), so the
    spine carries one piece while the rack links reduce the next and share the last.
    Every rank of the default group must construct this at the same point, since
    creating a group is itself a collective over the whole world.
    """

    def __init__(self, plan: RackPlan, rank: int, timeout: timedelta,
                 piece_bytes: int = PIECE_BYTES) -> None:
        self.plan = plan
        self.rank = rank
        self.piece_bytes = piece_bytes
        # Subgroups get the library's default timeout (minutes) unless told: a member
        # whose partner left the step must give up as quickly as in the default group.
        reduce_groups = {rack: _group(rack, timeout) for rack in plan.racks}
        share_groups = {rack: _group(rack, timeout) for rack in plan.racks}
        cross_groups = [_group(plan.cross(j), timeout) for j in range(plan.shards)]
        self._rack = plan.rack_of(rank)
        self._reduce_group = reduce_groups[self._rack]
        self._share_group = share_groups[self._rack]
        local = self._rack.index(rank)
        self._shard = local if local < plan.shards else None
        self._cross_group = cross_groups[local] if self._shard is not None else None

    def allreduce_(self, flat: torch.Tensor) -> None:
        """Sum ``flat`` (one contiguous tensor) over the world, in place."""
        plan, rack = self.plan, self._rack
        count = max(1, min(MAX_PIECES, flat.numel() * flat.element_size() // self.piece_bytes))
        pieces = [[flat[a:b][x:y] for x, y in shard_bounds(b - a, plan.shards)]
                  for a, b in shard_bounds(flat.numel(), count)]
        in_rack = len(rack) > 1
        reduced = [[dist.reduce(shards[j], dst=rack[j], group=self._reduce_group,
                                async_op=True) for j in range(plan.shards)] if in_rack else []
                   for shards in pieces]
        crossed = []
        for shards, works in zip(pieces, reduced, strict=True):
            _wait_all(works)
            if self._shard is not None:
                crossed.append(dist.all_reduce(shards[self._shard], group=self._cross_group,
                                               async_op=True))
        shared = []
        for i, shards in enumerate(pieces):
            if self._shard is not None:
                _wait_all([crossed[i]])
            if in_rack:
                shared += [dist.broadcast(shards[j], src=rack[j], group=self._share_group,
                                          async_op=True) for j in range(plan.shards)]
        _wait_all(shared)


def _group(ranks: tuple[int, ...], timeout: timedelta) -> dist.ProcessGroup | None:
    """A new process group of ``ranks``; None on the ranks outside it."""
    group = dist.new_group(list(ranks), timeout=timeout)
    return group if isinstance(group, dist.ProcessGroup) else None


def _wait_all(works: Iterable[dist.Work | None]) -> None:
    """Wait for every asynchronous operation (launched together, so they overlap)."""
    for work in list(works):
        if work is not None:
            work.wait()
