"""Which server holds each shard, pure: a job's fixed shards on its changing servers.

A job's shards are fixed for its life (the model's partition never changes); its servers
may grow and shrink (``spec.ps.replicas``). Shard *s*'s primary lives on its *home* and
its replica on the next server, ``(home + 1) mod n``.

With as many servers as shards, shard *s*'s home is server *s*. With fewer, the homes are
what taking servers away one at a time, last first, gives: the leaving server's shards
go, lowest first, to the least loaded of the others (the lower index on a tie). Growing
back is the same steps reversed. So a resize from *n* to *n ± 1* servers moves only the
shards of the server that joins or leaves, and every server holds within one shard of
every other. More servers than shards: servers past the last shard hold none.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@functools.lru_cache(maxsize=64)
def homes(shards: int, servers: int) -> tuple[int, ...]:
    """The home server of every shard (see the module doc)."""
    if shards < 1 or servers < 1:
        raise ValueError(f"need at least one shard and one server, got {shards} and {servers}")
    home = list(range(shards))
    held = [[s] for s in range(shards)]
    for leaving in range(shards - 1, servers - 1, -1):
        for shard in held.pop():
            target = min(range(leaving), key=lambda i: (len(held[i]), i))
            held[target].append(shard)
            home[shard] = target
    return tuple(home)


@dataclass(frozen=True)
class Placement:
    """Where the primary and the replica of each of ``shards`` shards live on ``servers``
    servers."""

    shards: int
    servers: int

    def home(self, shard: int) -> int:
        """The server that serves ``shard`` as primary while none has failed."""
        return homes(self.shards, self.servers)[shard]

    def replica_host(self, shard: int) -> int:
        """The server that keeps the replica of ``shard``."""
        return (self.home(shard) + 1) % self.servers

    def other_copy(self, shard: int, at: int) -> int:
        """The server holding the other copy of ``shard`` when one copy is at ``at``: the
        replica host for the home, else the home (a failover or a move left it at ``at``)."""
        return self.replica_host(shard) if at == self.home(shard) else self.home(shard)

    def keeps(self, shard: int, server: int) -> bool:
        """Whether a copy of ``shard`` belongs on ``server`` (its home or replica host)."""
        return server in (self.home(shard), self.replica_host(shard))


@dataclass(frozen=True)
class Move:
    """Shard ``shard``'s primary goes from server ``source`` to server ``target``."""

    shard: int
    source: int
    target: int


def moves(shards: int, before: int, after: int) -> list[Move]:
    """The primaries a resize from ``before`` to ``after`` servers moves (none failed)."""
    old, new = homes(shards, before), homes(shards, after)
    return [Move(s, a, b) for s, (a, b) in enumerate(zip(old, new, strict=True)) if a != b]


def handovers(before: Placement, after: Placement, me: int,
              primaries: list[int]) -> dict[int, int]:
    """Of the shards server ``me`` serves as primary, those it hands over after a resize
    from ``before`` to ``after``, each with its new home: the shards whose home moved,
    and every shard when ``me`` leaves. A primary that is here after a failover and whose
    home did not move stays (as it would without the resize)."""
    leaving = me >= after.servers
    return {s: after.home(s) for s in sorted(primaries)
            if after.home(s) != me and (leaving or before.home(s) != after.home(s))}
