"""Hierarchical all-reduce: inside each rack, across racks, back inside the rack.

A flat ring over N members takes 2(N-1) steps, and every step waits on the slowest
edge, so the oversubscribed, higher-latency spine is paid on each of them. Here the
buffer is cut into ``m`` shards (``m``: the size of the smallest rack). Shard ``j`` is
first reduced inside every rack onto the rack's ``j``-th member, then all-reduced
across racks among the ``j``-th members (one member per rack, ``m`` such rings in
parallel), then sent back from the ``j``-th member to every member of its rack. The
spine then carries 2(R-1) steps of R racks instead of 2(N-1), and every rack, even or
uneven, takes part with all of its members.

:func:`rack_plan` decides from the world alone (the same answer on every rank);
:class:`RackGroups` holds the process groups of one generation, built right after the
default group and destroyed with it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ringwright.world import HierarchicalAllReduce, World

PIECE_BYTES = 128 << 10
"""Pipeline granularity: a buffer goes through the three stages in pieces of this size
(at most ``MAX_PIECES``). Small pieces fill the pipeline sooner; each piece costs a
spine round of its own and three collectives' overhead. Tuned on the emulated network
(``tests/bench/bench_network.py``): 64 KiB-1 MiB pieces of 0.25-4 MB buffers."""
MAX_PIECES = 16
AUTO_MAX_BYTES = 512 << 10
"""Under ``Auto``, buffers up to this size go hierarchical and larger ones the flat
ring. Hierarchical saves spine *latency* (2(R-1) spine steps instead of 2(N-1)), not
bytes: at 4:1 every worker link carries as much as in a world-ordered flat ring, so
once a buffer is large enough for bandwidth to dominate the extra stages cost more than
the latency saved. Measured on the emulated 4:1 network (``tests/bench/bench_network.py``,
2 and 5 ms spine delay): 0.25 MB 0.97-2.99x the flat ring, 1 MB 0.70-1.19x, 4 MB
0.75-0.94x. ``Enabled`` takes every size."""
LANES = 2
"""Cross-rack groups per shard, used in turn by successive pieces: a gloo group runs at
most two operations at once, and the spine's latency needs more pieces in flight."""


@dataclass(frozen=True)
class RackPlan:
    """Which ranks share a rack, and how many shards cross the spine."""

    racks: tuple[tuple[int, ...], ...]
    """Ranks of every rack, racks in ring order."""
    max_bytes: int | None = None
    """Largest buffer that goes hierarchical; None: any."""

    def takes(self, nbytes: int) -> bool:
        """Whether a buffer of ``nbytes`` goes hierarchical (the flat ring otherwise)."""
        return self.max_bytes is None or nbytes <= self.max_bytes

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


def rack_plan(world: World, backend: str = "gloo") -> RackPlan | None:
    """The two-level plan for ``world``, or None where the flat ring is used.

    Auto goes hierarchical when the world spans several racks and at least one rack
    holds several members (with one member per rack both are the same ring), for
    buffers up to :data:`AUTO_MAX_BYTES`. Under NCCL, Auto is the flat all-reduce:
    :data:`AUTO_MAX_BYTES` was measured with gloo over emulated links, and NCCL picks
    its own algorithm (ring, tree, NVLS, CollNet) from the topology it detects; only
    ``Enabled`` overrides that choice.
    """
    mode = world.topology.hierarchical_all_reduce
    racks = world.racks()
    if mode is HierarchicalAllReduce.DISABLED or len(racks) < 2:
        return None
    if mode is HierarchicalAllReduce.AUTO:
        if backend == "nccl":
            return None
        if all(len(r) == 1 for r in racks):
            return None
        return RackPlan(racks, AUTO_MAX_BYTES)
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
    """The rack and cross-rack process groups of one generation, for one rank.

    Each stage is one collective: an all-to-all inside the rack sends shard ``j`` of
    every member to the rack's ``j``-th member, which sums what it got (a reduce-scatter
    that moves each byte once; gloo's own reduce-scatter is a whole all-reduce); the
    ring all-reduce across racks; an all-to-all that sends every reduced shard back to
    all rack members. The buffer goes through in pieces, as a pipeline with a process
    group per stage, so the spine carries one piece while the rack links scatter the
    next and share the last. Every rank of the default group must construct this at
    the same point, since creating a group is itself a collective over the whole world.
    """

    def __init__(self, plan: RackPlan, rank: int, timeout: timedelta,
                 piece_bytes: int = PIECE_BYTES, lanes: int = LANES) -> None:
        self.plan = plan
        self.rank = rank
        self.piece_bytes = piece_bytes
        # Subgroups get the library's default timeout (minutes) unless told: their
        # connections form within ``timeout`` (the group init's), as the default group's
        # do; the backend then gives their collectives the default group's timeout.
        scatter_groups = {rack: _group(rack, timeout) for rack in plan.racks}
        share_groups = {rack: _group(rack, timeout) for rack in plan.racks}
        cross_groups = [[_group(plan.cross(j), timeout) for _ in range(lanes)]
                        for j in range(plan.shards)]
        self._groups = [g for g in (*scatter_groups.values(), *share_groups.values(),
                                    *(g for lane in cross_groups for g in lane))
                        if g is not None]
        self._rack = plan.rack_of(rank)
        self._scatter_group = scatter_groups[self._rack]
        self._share_group = share_groups[self._rack]
        local = self._rack.index(rank)
        self._shard = local if local < plan.shards else None
        self._cross_lanes = cross_groups[local] if self._shard is not None else []
        # Pieces on the spine before the oldest is shared: two per lane run at once.
        self._lag = 2 * lanes - 1

    def set_timeout(self, timeout: timedelta) -> None:
        """The timeout of this rank's rack and cross-rack groups' later collectives."""
        for group in self._groups:
            group.set_timeout(timeout)

    def allreduce_(self, flat: torch.Tensor) -> None:
        """Sum ``flat`` (one contiguous tensor) over the world, in place."""
        count = max(1, min(MAX_PIECES, flat.numel() * flat.element_size() // self.piece_bytes))
        pieces = [flat[a:b] for a, b in shard_bounds(flat.numel(), count)]
        scattered = [self._scatter(piece) for piece in pieces]
        crossed = []
        shared = []
        for i, piece in enumerate(pieces):
            # Sum and send on each piece as soon as it is scattered.
            crossed.append(self._cross(i, piece, *scattered[i]))
            # Share a piece once the next ones are on the spine: all links stay busy.
            if i >= self._lag:
                shared.append(self._share(pieces[i - self._lag], crossed[i - self._lag]))
        for i in range(max(0, len(pieces) - self._lag), len(pieces)):
            shared.append(self._share(pieces[i], crossed[i]))
        _wait_all(shared)

    def _sizes(self, piece: torch.Tensor) -> list[int]:
        """Length of every shard of ``piece``, then 0 for each member owning none."""
        shards = [b - a for a, b in shard_bounds(piece.numel(), self.plan.shards)]
        return shards + [0] * (len(self._rack) - len(shards))

    def _own(self, piece: torch.Tensor) -> torch.Tensor | None:
        """This member's shard of ``piece``; None where it owns none."""
        if self._shard is None:
            return None
        a, b = shard_bounds(piece.numel(), self.plan.shards)[self._shard]
        return piece[a:b]

    def _scatter(self, piece: torch.Tensor) -> tuple[dist.Work | None, torch.Tensor | None]:
        """Start sending every shard of ``piece`` to its owner in the rack; the work and
        the buffer that receives this member's shard from every rack member."""
        own = self._own(piece)
        if len(self._rack) == 1:
            return None, None
        members = len(self._rack)
        got = piece.new_empty(members * (0 if own is None else own.numel()))
        work = dist.all_to_all_single(got, piece, [got.numel() // members] * members,
                                      self._sizes(piece), group=self._scatter_group,
                                      async_op=True)
        return work, got

    def _cross(self, index: int, piece: torch.Tensor, scatter: dist.Work | None,
               got: torch.Tensor | None) -> dist.Work | None:
        """Once ``piece`` is scattered, sum this member's shard and start its
        all-reduce across racks."""
        _wait_all([scatter])
        own = self._own(piece)
        if own is None:
            return None
        if got is not None:
            torch.sum(got.view(len(self._rack), -1), dim=0, out=own)
        if own.numel() == 0:
            return None
        return dist.all_reduce(own, group=self._cross_lanes[index % len(self._cross_lanes)],
                               async_op=True)

    def _share(self, piece: torch.Tensor, cross: dist.Work | None) -> dist.Work | None:
        """Once this member's shard of ``piece`` is summed over the world, start sending
        it to every rack member and receiving theirs into ``piece``."""
        if len(self._rack) == 1:
            return cross
        _wait_all([cross])
        own = self._own(piece)
        members = len(self._rack)
        out = piece.new_empty(0) if own is None else own.repeat(members)
        return dist.all_to_all_single(piece, out, self._sizes(piece),
                                      [out.numel() // members] * members,
                                      group=self._share_group, async_op=True)


def _group(ranks: tuple[int, ...], timeout: timedelta) -> dist.ProcessGroup | None:
    """A new process group of ``ranks``; None on the ranks outside it."""
    group = dist.new_group(list(ranks), timeout=timeout)
    return group if isinstance(group, dist.ProcessGroup) else None


def _wait_all(works: Iterable[dist.Work | None]) -> None:
    """Wait for every asynchronous operation (launched together, so they overlap)."""
    for work in list(works):
        if work is not None:
            work.wait()
