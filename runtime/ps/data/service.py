"""The data-shard service: pieces of each epoch handed to workers, with exact accounting.

A worker leases a piece (a range of sample indices), trains it batch by batch and
reports each batch with the push that carries its gradients, so the queue knows how far
every lease got. When a worker leaves or dies, the rest of its pieces go back to the
queue. Each epoch's samples are counted apart: trained (their gradients applied),
dropped as stale, and re-queued. With ``requeue_stale`` every dropped sample goes back
to the queue, so every sample is trained exactly once; without it, every sample is
trained once or dropped once, and counted as such.
Pure: the parameter server hosting it calls it under its lock.

Every change is one :data:`Op` and the service is deterministic, so a replica that
replays the primary's ops in order (its *journal*, numbered by ``seq`` within a
primary's ``term``) holds exactly the primary's queue: a failover then neither loses
nor repeats a reported sample.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

Op = list[Any]
"""One change, as JSON: ``["lease", worker]``, ``["report", worker, piece, start, stop,
dropped]`` or ``["release", worker]``."""


class LeaseStatus(StrEnum):
    GRANTED = "granted"
    WAIT = "wait"
    """Nothing to hand out until other workers finish this epoch's pieces."""
    DONE = "done"
    """Every epoch is trained."""


@dataclass
class Piece:
    id: int
    epoch: int
    start: int
    stop: int
    done_upto: int = -1
    """First sample not yet reported (``start`` when nothing was)."""

    def __post_init__(self) -> None:
        if self.done_upto < 0:
            self.done_upto = self.start


@dataclass(frozen=True)
class Lease:
    status: LeaseStatus
    piece: int = -1
    epoch: int = -1
    start: int = 0
    stop: int = 0


@dataclass
class Accounting:
    """Samples per epoch, each table apart."""

    trained: dict[int, int] = field(default_factory=dict)
    """Reported with gradients that were applied."""
    dropped: dict[int, int] = field(default_factory=dict)
    """Reported with gradients that were dropped as stale."""
    requeued: dict[int, int] = field(default_factory=dict)
    """Left untrained by a worker that left or died, and put back in the queue."""
    requeued_stale: dict[int, int] = field(default_factory=dict)
    """Dropped as stale and put back in the queue (``requeue_stale``): trained again."""

    def add(self, table: dict[int, int], epoch: int, count: int) -> None:
        table[epoch] = table.get(epoch, 0) + count


class DataShardService:
    """Hands out pieces of ``epochs`` epochs of ``samples`` samples, ``piece_size`` each."""

    def __init__(self, samples: int, piece_size: int, epochs: int,
                 *, requeue_stale: bool = False) -> None:
        if samples < 1 or piece_size < 1 or epochs < 1:
            raise ValueError("samples, piece_size and epochs must be >= 1")
        self.samples, self.piece_size, self.epochs = samples, piece_size, epochs
        self.requeue_stale = requeue_stale
        self.epoch = 0
        self.term = 0
        """Bumped when a replica takes over as primary: its journal starts anew."""
        self.seq = 0
        """Changes made in this term."""
        self.accounting = Accounting()
        self._next_id = 0
        self._queue: deque[Piece] = deque()
        self._leased: dict[int, tuple[str, Piece]] = {}
        self._fill(0)

    def _fill(self, epoch: int) -> None:
        for start in range(0, self.samples, self.piece_size):
            self._enqueue(epoch, start, min(start + self.piece_size, self.samples))

    def _enqueue(self, epoch: int, start: int, stop: int) -> None:
        self._queue.append(Piece(self._next_id, epoch, start, stop))
        self._next_id += 1

    @property
    def done(self) -> bool:
        return self.epoch >= self.epochs

    def lease(self, worker: str) -> Lease:
        """The next piece for ``worker``; the piece it holds already, if any (a worker
        trains one at a time, so it asks again only when it lost the answer, or when a
        report of its was refused: it goes on from the last sample reported)."""
        held = self._held(worker)
        if held is not None:
            return Lease(LeaseStatus.GRANTED, held.id, held.epoch, held.done_upto, held.stop)
        if not self._queue and not self._leased and not self.done:
            self.epoch += 1
            self.seq += 1
            if not self.done:
                self._fill(self.epoch)
        if self.done:
            return Lease(LeaseStatus.DONE)
        if not self._queue:
            return Lease(LeaseStatus.WAIT)
        piece = self._queue.popleft()
        self._leased[piece.id] = (worker, piece)
        self.seq += 1
        return Lease(LeaseStatus.GRANTED, piece.id, piece.epoch, piece.done_upto, piece.stop)

    def _held(self, worker: str) -> Piece | None:
        return min((p for holder, p in self._leased.values() if holder == worker),
                   key=lambda p: p.id, default=None)

    def report(self, worker: str, piece_id: int, start: int, stop: int, *,
               dropped: bool) -> bool:
        """Samples ``[start, stop)`` of a leased piece are trained (or their gradients
        were dropped). Returns False for a report that does not fit the lease (a
        worker that was already given up on): it is ignored."""
        held = self._leased.get(piece_id)
        if held is None or held[0] != worker:
            return False
        piece = held[1]
        if piece.start <= start < stop <= piece.done_upto:
            return True  # reported already: a retry after a lost answer
        if start != piece.done_upto or not start < stop <= piece.stop:
            return False
        self.seq += 1
        piece.done_upto = stop
        if dropped:
            self.accounting.add(self.accounting.dropped, piece.epoch, stop - start)
            if self.requeue_stale:
                self._enqueue(piece.epoch, start, stop)
                self.accounting.add(self.accounting.requeued_stale, piece.epoch, stop - start)
        else:
            self.accounting.add(self.accounting.trained, piece.epoch, stop - start)
        if stop == piece.stop:
            del self._leased[piece_id]
        return True

    def release(self, worker: str) -> int:
        """Return every unfinished piece of ``worker`` to the front of the queue;
        the number of samples re-queued."""
        count = 0
        for piece_id, (holder, piece) in sorted(self._leased.items()):
            if holder != worker:
                continue
            del self._leased[piece_id]
            count += piece.stop - piece.done_upto
            self.accounting.add(self.accounting.requeued, piece.epoch,
                                piece.stop - piece.done_upto)
            self._queue.appendleft(piece)
            self.seq += 1
        return count

    def perform(self, op: Op) -> Lease | bool | int:
        """Carry out one :data:`Op` (the primary's journal, replayed on its replica)."""
        kind, worker = op[0], str(op[1])
        if kind == "lease":
            return self.lease(worker)
        if kind == "report":
            return self.report(worker, int(op[2]), int(op[3]), int(op[4]), dropped=bool(op[5]))
        if kind == "release":
            return self.release(worker)
        raise ValueError(f"unknown data-service op {kind!r}")

    def holders(self) -> set[str]:
        """Workers holding a lease now."""
        return {holder for holder, _ in self._leased.values()}

    def to_json(self) -> dict[str, object]:
        """The whole queue, for replication to the backup."""
        def enc(p: Piece) -> list[int]:
            return [p.id, p.epoch, p.start, p.stop, p.done_upto]

        a = self.accounting
        return {"samples": self.samples, "pieceSize": self.piece_size, "epochs": self.epochs,
                "requeueStale": self.requeue_stale, "epoch": self.epoch, "nextId": self._next_id,
                "term": self.term, "seq": self.seq,
                "queue": [enc(p) for p in self._queue],
                "leased": [[w, enc(p)] for w, p in self._leased.values()],
                "trained": _keys(a.trained), "dropped": _keys(a.dropped),
                "requeued": _keys(a.requeued), "requeuedStale": _keys(a.requeued_stale)}

    @classmethod
    def from_json(cls, doc: dict[str, object]) -> DataShardService:
        """Rebuild a queue from :meth:`to_json`."""
        def num(key: str) -> int:
            value = doc[key]
            assert isinstance(value, int)
            return value

        svc = cls(num("samples"), num("pieceSize"), num("epochs"),
                  requeue_stale=bool(doc["requeueStale"]))
        svc.epoch, svc._next_id = num("epoch"), num("nextId")
        svc.term, svc.seq = num("term"), num("seq")
        queue, leased = doc["queue"], doc["leased"]
        assert isinstance(queue, list) and isinstance(leased, list)
        svc._queue = deque(Piece(*p) for p in queue)
        svc._leased = {p[0]: (w, Piece(*p)) for w, p in leased}
        for key, table in (("trained", svc.accounting.trained),
                           ("dropped", svc.accounting.dropped),
                           ("requeued", svc.accounting.requeued),
                           ("requeuedStale", svc.accounting.requeued_stale)):
            entries = doc.get(key, {})  # absent from a checkpoint of an older version
            assert isinstance(entries, dict)
            table.update({int(k): int(v) for k, v in entries.items()})
        return svc


def _keys(table: dict[int, int]) -> dict[str, int]:
    return {str(k): v for k, v in table.items()}
