"""Shards handed to their new homes when the job's servers grow or shrink.

After a resize each server works out which of its primary shards now belong elsewhere
(:func:`..placement.handovers`). Replication already sends such a shard to its new home
(a copy away from its home goes home, :meth:`.replication.Replicator.target`), so the new
home is up and holds a recent copy before anything waits for it. Then the shard is
handed over (:meth:`.server.ParameterServer.hand_over`): under the shard's lock what
changed since that copy (the whole state if the new home holds no such copy) leaves for
the new home, which serves it as primary from then on; calls for the shard wait
meanwhile and then follow it there. The time the shard is served by nobody is
logged with each move (``ps_moved ... held_s``).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import grpc

from ...kvlog import log_event, runtime_logger
from ..placement import Placement, handovers
from ..wire.codec import Header, Tensors
from .replication import Replicator, Send
from .server import ParameterServer

_log = runtime_logger("ps.server")


@dataclass(frozen=True)
class Moved:
    """One shard handed over: to which server, at which version, ``nbytes`` of state,
    served by nobody for ``held_s`` seconds."""

    shard: int
    to: int
    version: int
    nbytes: int
    held_s: float


class Mover:
    """The hand-overs this server owes after resizes, tried every round until done."""

    def __init__(self, ps: ParameterServer, send: Send, address: str = "",
                 logger: logging.Logger = _log) -> None:
        """``send``: delivers an ``Adopt`` to a server's address; ``address``: this
        server's own, named in each hand-over so that the new home can refresh the copy
        left here with changes only."""
        self.ps, self.send, self.address, self.log = ps, send, address, logger
        self.pending: dict[int, int] = {}
        """Shard -> the server it goes to."""
        self.whole: set[int] = set()
        """Shards whose new home did not hold the copy a hand-over was based on."""

    def resized(self, before: int, after: int) -> None:
        """The job went from ``before`` to ``after`` servers: plan this server's
        hand-overs (replacing those planned for an earlier size)."""
        config = self.ps.config
        if config is None:
            return  # no shard yet, so none to move
        self.pending = handovers(Placement(config.shards, before),
                                 Placement(config.shards, after), self.ps.index,
                                 self.ps.primaries())

    def round(self, addresses: list[str], replicator: Replicator) -> list[Moved]:
        """Hand over each pending shard whose new home accepted a copy of it (so is up
        and configured); the shards handed over."""
        done: list[Moved] = []
        primaries = set(self.ps.primaries())
        for shard, target in list(self.pending.items()):
            if shard not in primaries:
                del self.pending[shard]  # failed over meanwhile: no longer this server's
                continue
            address = addresses[target]
            seeded, base = replicator.accepted.get(shard, ("", 0))
            if seeded != address:
                continue  # not seeded yet: the new home may still be starting
            sent: list[Header] = []
            moved = self.ps.hand_over(
                shard, functools.partial(self._adopt, address, sent=sent),
                None if shard in self.whole else base, to=target)
            if moved is None:
                if any(r.get("whole") for r in sent):
                    self.whole.add(shard)  # its copy changed meanwhile: send it all
                elif refused := [r for r in sent if r.get("accepted") is False]:
                    # The new home serves the shard already (a worker promoted its copy
                    # there): replication settles which copy stays, as after a failover.
                    del self.pending[shard]
                    log_event(self.log, logging.WARNING, "ps_move_refused", shard=shard,
                              to=target, version=refused[0].get("version"))
                continue
            del self.pending[shard]
            self.whole.discard(shard)
            version, held = moved
            nbytes = int(sent[-1]["nbytes"])
            done.append(Moved(shard, target, version, nbytes, held))
            log_event(self.log, logging.INFO, "ps_moved", shard=shard, to=target,
                      address=address, version=version, bytes=nbytes, held_s=f"{held:.4f}",
                      at=f"{time.time():.3f}")
        return done

    def _adopt(self, address: str, header: Header, tensors: Tensors,
               sent: list[Header]) -> bool:
        """Send the shard to ``address``; its reply, with the bytes sent (``nbytes``), is
        added to ``sent``."""
        try:
            reply = self.send(address, {**header, "from": self.address}, tensors)
        except grpc.RpcError as exc:
            log_event(self.log, logging.WARNING, "ps_move_failed", shard=header["shard"],
                      to=address, error=exc.code())
            return False
        sent.append({**reply, "nbytes": sum(t.nbytes for t in tensors.values())})
        return reply.get("accepted") is True
