"""The data-shard service's journal: each change, sent to the server that keeps shard 0's
other copy before the change is answered.

The service is deterministic (:mod:`.dataservice`), so a replica that replays the
primary's changes in order holds exactly the primary's queue, and a failover of shard 0
neither repeats nor loses a reported sample. Entries are numbered by the service's
``seq`` within a primary's ``term``.

The primary's side (:class:`JournalOut`) follows the copies of shard 0 that replication
sends. Once a copy is accepted by an address, every change is sent there, also while
later copies travel (the replica keeps the newer of its copy and an arriving one). A
change is recorded while the service's lock is held, which fixes the order, and sent
after the shard's lock is let go: whoever flushes first sends everything recorded so far
in one message, and the others find their change sent (group commit). A send that fails
stops the journal; while the first copy to an address is on its way, changes wait and
follow once it is accepted. A dead or frozen replica host so costs one send's deadline,
not one per change.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..wire.codec import Header
from .service import DataShardService

JournalSend = Callable[[str, list[Header]], bool]
"""Deliver journal entries, in order, to the server at an address; False when they are
not kept there (unreachable, out of order, or serving shard 0 itself)."""

QUEUE_LIMIT = 100_000
"""Changes kept unsent; beyond it they are given up for the next whole copy."""


class JournalOut:
    """Where a primary's changes go: nowhere, held behind a copy on its way to an
    address, or to the address that accepted the copy."""

    def __init__(self, send: JournalSend | None) -> None:
        self.send = send
        self.lock = threading.Lock()
        """Held from a change of the service until it is recorded here: entries leave
        in the order the changes were made."""
        self._flushing = threading.Lock()
        """One send at a time; who waits behind it mostly finds its entry sent."""
        self._to: str | None = None
        self._waiting_for: str | None = None
        """The address a copy is on its way to."""
        self._outbox: list[Header] = []
        self._recorded = 0
        """Entries recorded so far: an entry's ticket is this count after it."""
        self._settled = 0
        """Tickets up to here are sent, or covered by a copy taken after them."""

    def record(self, entry: Header) -> int:
        """Keep one change for sending (holds :attr:`lock`); the ticket to
        :meth:`flush`, 0 when there is nothing to wait for."""
        if self.send is None or (self._to is None and self._waiting_for is None):
            return 0
        self._outbox.append(entry)
        self._recorded += 1
        if len(self._outbox) > QUEUE_LIMIT:
            self.off()
            return 0
        return self._recorded

    def flush(self, ticket: int) -> bool:
        """Send what was recorded up to ``ticket`` (with whatever followed it); False
        when a send failed: the journal is off, and the caller has the next replication
        send a whole copy. Changes held behind a copy on its way count as kept."""
        with self._flushing:
            with self.lock:
                if ticket <= self._settled or self._to is None or self.send is None:
                    return True
                batch, to, upto = list(self._outbox), self._to, self._recorded
            sent = self.send(to, batch)
            with self.lock:
                if self._to != to or self._settled >= upto:
                    return True  # a copy taken meanwhile covers the batch
                if sent:
                    del self._outbox[:len(batch)]
                    self._settled = upto
                else:
                    self.off()
            return sent

    def latest(self) -> int:
        """The ticket of the newest change recorded."""
        with self.lock:
            return self._recorded

    def copy_taken(self, to: str) -> None:
        """A copy of the service was taken for ``to`` (holds :attr:`lock`): it covers
        every change recorded so far; hold later ones until it is accepted there,
        unless ``to`` already replays them."""
        if self.send is not None and to != self._to:
            self.off()
            self._waiting_for = to

    def copy_accepted(self, to: str) -> bool:
        """``to`` keeps the copy taken for it: send what waited behind it, then journal
        there. False when a send failed (off again; the next copy re-arms it)."""
        with self.lock:
            if self._waiting_for != to:
                return True  # superseded by a newer copy, or turned off since
            self._to, self._waiting_for = to, None
            ticket = self._recorded
        return self.flush(ticket)

    def off(self) -> None:
        """Stop journaling until the next copy (holds :attr:`lock`); what is unsent is
        given up (that copy will cover it)."""
        self._to = self._waiting_for = None
        self._outbox.clear()
        self._settled = self._recorded


class JournalIn:
    """A replica's copy of the service and the changes replayed onto it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._copy: DataShardService | None = None

    def copy(self, svc: DataShardService) -> None:
        """A whole copy from the primary; one that is older than what is held (a late
        delivery) is ignored."""
        with self.lock:
            held = self._copy
            if held is None or (svc.term, svc.seq) > (held.term, held.seq):
                self._copy = svc

    def entries(self, entries: list[Header]) -> bool:
        """Replay changes in order. True when each is applied or was already; False
        when one does not follow the copy held (a change was missed: the primary sends
        a whole copy) or when replaying it came out other than on the primary."""
        with self.lock:
            return all(self._entry(entry) for entry in entries)

    def _entry(self, entry: Header) -> bool:
        held = self._copy
        if held is None:
            return False
        key, at = (int(entry["term"]), int(entry["from"])), (held.term, held.seq)
        if (key[0], int(entry["seq"])) <= at:
            return True
        if key != at:
            return False
        held.perform(entry["op"])
        if held.seq != int(entry["seq"]):
            self._copy = None
            return False
        return True

    def take(self) -> DataShardService | None:
        """The service as replicated, for serving it after a failover (this replica is
        done with it)."""
        with self.lock:
            svc, self._copy = self._copy, None
            return svc
