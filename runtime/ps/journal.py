"""The data-shard service's journal: each change, sent to the server that keeps shard 0's
other copy before the change is answered.

The service is deterministic (:mod:`.dataservice`), so a replica that replays the
primary's changes in order holds exactly the primary's queue, and a failover of shard 0
neither repeats nor loses a reported sample. Entries are numbered by the service's
``seq`` within a primary's ``term``.

The primary's side (:class:`JournalOut`) follows the copies of shard 0 that replication
sends. Once a copy is accepted by an address, every change is sent there as it is made,
also while later copies travel (the replica keeps the newer of its copy and an arriving
one). A send that fails stops the journal; while the first copy to an address is on its
way, changes wait in a queue and follow once it is accepted. A dead or frozen replica
host so costs one send's deadline, not one per change.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .codec import Header
from .dataservice import DataShardService

JournalSend = Callable[[str, Header], bool]
"""Deliver one journal entry to the server at an address; False when it is not kept
there (unreachable, out of order, or serving shard 0 itself)."""

QUEUE_LIMIT = 100_000
"""Changes kept while a copy is on its way; beyond it the copy is superseded."""


class JournalOut:
    """Where a primary's changes go: nowhere, queued behind a copy on its way to an
    address, or straight to the address that accepted the copy."""

    def __init__(self, send: JournalSend | None) -> None:
        self.send = send
        self.lock = threading.Lock()
        """Held from a change of the service until it is recorded here: entries leave
        in the order the changes were made."""
        self._to: str | None = None
        self._queue: tuple[str, list[Header]] | None = None

    def record(self, entry: Header) -> bool:
        """Send or queue one change (holds :attr:`lock`); False when a send failed: the
        journal is off, and the caller has the next replication send a whole copy."""
        if self._queue is not None:
            self._queue[1].append(entry)
            if len(self._queue[1]) <= QUEUE_LIMIT:
                return True
            self._queue = None
            return False
        if self._to is None or self.send is None:
            return True
        if self.send(self._to, entry):
            return True
        self._to = None
        return False

    def copy_taken(self, to: str) -> None:
        """A copy of the service was taken for ``to`` (holds :attr:`lock`): queue the
        changes that follow it until it is accepted there, unless ``to`` already
        replays them."""
        if self.send is not None and to != self._to:
            self._to, self._queue = None, (to, [])

    def copy_accepted(self, to: str) -> bool:
        """``to`` keeps the copy taken for it: send what queued behind it, then journal
        there. False when a send failed (off again; the next copy re-arms it)."""
        with self.lock:
            if self._queue is None or self._queue[0] != to:
                return True  # superseded by a newer copy, or turned off since
            queued, self._queue = self._queue[1], None
            self._to = to
            return all(self.record(entry) for entry in queued)

    def off(self) -> None:
        """Stop journaling until the next copy (this server no longer serves the
        service as primary, or starts to)."""
        self._to, self._queue = None, None


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

    def entry(self, entry: Header) -> bool:
        """Replay one change. True when it is applied or was already; False when it
        does not follow the copy held (a change was missed: the primary sends a whole
        copy) or when replaying it came out other than on the primary."""
        with self.lock:
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
