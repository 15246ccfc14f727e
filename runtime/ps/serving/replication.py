"""A PS's primary shards sent to the server that keeps the other copy, and what a
refusal means; and the journal of the data-shard service, sent change by change to the
server that keeps shard 0's other copy.

A replica host refuses a shard it serves as primary itself: some worker could not
reach this server and promoted the replica while this one was still alive. Two
primaries for one shard would let the two copies drift apart, so the home server
(the one whose replica host refused) steps down and becomes the replica; the
promoted copy then re-seeds it like any replacement.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc

from ...kvlog import log_event, runtime_logger
from ..placement import Placement
from ..wire.codec import Header, Tensors
from ..wire.transport import DETECT_S, Stub
from .server import ParameterServer

_log = runtime_logger("ps.server")

Send = Callable[[str, Header, Tensors], Header]
"""Deliver a ``Replicate`` to the server at an address; its reply."""


class StubSend:
    """:data:`Send` through a :class:`..wire.transport.Stub` (a ``method`` of the server,
    on the plane that carries it), one per address."""

    def __init__(self, timeout: float = 30.0, method: str = "Replicate",
                 detect_s: float = DETECT_S) -> None:
        self.timeout, self.method, self.detect_s = timeout, method, detect_s
        self._stubs: dict[str, Stub] = {}

    def __call__(self, address: str, header: Header, tensors: Tensors) -> Header:
        stub = self._stubs.get(address) or self._stubs.setdefault(
            address, Stub(address, self.detect_s))
        reply, _ = stub.call(self.method, header, tensors, timeout=self.timeout)
        return reply


class GrpcJournal:
    """:data:`~.journal.JournalSend` over gRPC. The deadline is short: a change is not
    answered until it is sent, and a failed send only costs a whole copy at the next
    round."""

    def __init__(self, timeout: float = 2.0, logger: logging.Logger = _log,
                 detect_s: float = DETECT_S) -> None:
        self.send = StubSend(timeout, "Journal", detect_s)
        self.log = logger

    def __call__(self, address: str, entries: list[Header]) -> bool:
        try:
            reply = self.send(address, {"entries": entries}, {})
        except grpc.RpcError as exc:
            log_event(self.log, logging.INFO, "ps_journal_failed", to=address,
                      seq=entries[-1]["seq"], error=exc.code())
            return False
        return reply.get("accepted") is True


class Replicator:
    """Sends changed primary shards to the server that keeps their other copy."""

    def __init__(self, ps: ParameterServer, servers: int, send: Send | None = None,
                 logger: logging.Logger = _log, every_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``servers``: the job's servers until a round says otherwise (each round
        follows the addresses it is given); ``every_s``: a round sends only this long
        after the last one that did, unless the servers changed."""
        self.ps, self.servers = ps, servers
        self.send = send or StubSend()
        self.log = logger
        self.every_s, self.clock = every_s, clock
        self._last: tuple[float, list[str]] | None = None
        """When the last round that sent ran, and to which servers."""
        self._targets: dict[int, str] = {}
        self.accepted: dict[int, tuple[str, int]] = {}
        """Per shard: the address that last accepted a copy of it, and its version."""

    def target(self, shard: int) -> int:
        """A home shard's replica goes to the next server; a shard served elsewhere
        (after a failover, or on a server that is handing it to its new home after a
        resize) goes to its home (re-seeding a replacement, or seeding the new home)."""
        config = self.ps.config
        shards = config.shards if config is not None else self.servers
        return Placement(shards, self.servers).other_copy(shard, self.ps.index)

    def round(self, addresses: list[str]) -> None:
        """Send every primary shard changed since its last replication (``addresses``:
        every server of the job, by index), when due: ``every_s`` after the last round
        that sent, or at once when the servers changed (a new home or replica host is
        seeded without waiting)."""
        now = self.clock()
        if (self._last is not None and self._last[1] == addresses
                and now - self._last[0] < self.every_s):
            return
        self._last = (now, list(addresses))
        self.servers = len(addresses)
        for shard in self.ps.primaries():
            target = self.target(shard)
            if target == self.ps.index:
                continue
            address = addresses[target]
            if self._targets.get(shard) != address:
                self.ps.resend(shard)  # a new server there
                self._targets[shard] = address
                self.accepted.pop(shard, None)
                held = self.ps.held_at(shard)
                if held is not None and held[0] == address:
                    # The shard's old home: it keeps the version it handed over.
                    self.accepted[shard] = held
            seeded, base = self.accepted.get(shard, ("", 0))
            started = time.monotonic()
            snap = self.ps.snapshot(shard, to=address, base=base if seeded == address else None)
            if snap is None:
                continue
            taken = time.monotonic()
            try:
                reply = self.send(address, *snap)
                if "base" not in snap[0]:
                    log_event(self.log, logging.INFO, "ps_replicated_whole", shard=shard,
                              to=address, bytes=sum(t.nbytes for t in snap[1].values()),
                              copy_s=f"{taken - started:.4f}",
                              send_s=f"{time.monotonic() - taken:.4f}")
            except grpc.RpcError as exc:
                self.ps.resend(shard)
                log_event(self.log, logging.DEBUG, "ps_replicate_failed", shard=shard,
                          to=address, error=exc.code())
                continue
            if reply.get("whole"):
                # The changes did not fit the copy held there: send it all next round.
                self.accepted.pop(shard, None)
                self.ps.resend(shard)
            elif reply.get("accepted") is False:
                self._refused(shard, target, int(reply["version"]))
            else:
                self.accepted[shard] = (address, int(snap[0]["version"]))
                self.ps.copied(shard, address)

    def _refused(self, shard: int, target: int, theirs: int) -> None:
        """``target`` serves ``shard`` as primary too."""
        if shard != self.ps.index:
            # Promoted here, and the home server still claims the shard: it steps down
            # when its own replication to this server is refused; send again then.
            self.ps.resend(shard)
            return
        dropped = self.ps.step_down(shard)
        if dropped is not None:
            log_event(self.log, logging.WARNING, "ps_stepped_down", shard=shard,
                      primary=target, version=dropped["version"], primary_version=theirs,
                      round_dropped=dropped["roundDropped"])
