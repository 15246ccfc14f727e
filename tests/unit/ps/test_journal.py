"""The data-shard service's journal: what a primary sends, holds or stops sending, and
what a replica replays."""

from __future__ import annotations

import threading

from ringwright.runtime.ps.data import journal
from ringwright.runtime.ps.data.journal import JournalIn, JournalOut
from ringwright.runtime.ps.data.service import DataShardService
from ringwright.runtime.ps.wire.codec import Header


def _entry(seq: int, term: int = 0) -> Header:
    return {"term": term, "from": seq - 1, "seq": seq, "op": ["lease", f"w{seq}"]}


class Wire:
    """A send that records each message (address, seqs) and fails while ``down``."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, list[int]]] = []
        self.down = False

    def __call__(self, address: str, entries: list[Header]) -> bool:
        self.sent.append((address, [int(e["seq"]) for e in entries]))
        return not self.down


def _change(out: JournalOut, seq: int) -> int:
    with out.lock:
        return out.record(_entry(seq))


def _copy(out: JournalOut, to: str) -> None:
    with out.lock:
        out.copy_taken(to)


def _replaying(to: str) -> tuple[Wire, JournalOut]:
    """A journal whose copy ``to`` accepted: changes go there."""
    wire = Wire()
    out = JournalOut(wire)
    _copy(out, to)
    assert out.copy_accepted(to)
    return wire, out


def test_changes_wait_behind_a_copy_and_flow_once_it_is_accepted() -> None:
    wire = Wire()
    out = JournalOut(wire)
    assert _change(out, 1) == 0  # no copy yet: nowhere to send, nothing to wait for
    _copy(out, "b")
    two, three = _change(out, 2), _change(out, 3)
    assert out.flush(two) and out.flush(three) and wire.sent == []  # held, not sent
    assert out.copy_accepted("a") and wire.sent == []  # a copy for another address
    assert out.copy_accepted("b")
    assert wire.sent == [("b", [2, 3])]
    assert out.flush(_change(out, 4))
    assert wire.sent[-1] == ("b", [4])


def test_changes_made_while_a_send_is_out_leave_together() -> None:
    gate, entered = threading.Event(), threading.Event()
    sent: list[list[int]] = []

    def slow(address: str, entries: list[Header]) -> bool:
        sent.append([int(e["seq"]) for e in entries])
        entered.set()
        return gate.wait(10)

    out = JournalOut(slow)
    _copy(out, "b")
    assert out.copy_accepted("b")
    first = threading.Thread(target=out.flush, args=(_change(out, 1),))
    first.start()
    assert entered.wait(10)
    later = [_change(out, seq) for seq in (2, 3, 4)]  # recorded while 1 is on the wire
    flushers = [threading.Thread(target=out.flush, args=(t,)) for t in later]
    for t in flushers:
        t.start()
    gate.set()
    for t in [first, *flushers]:
        t.join(10)
    assert sent == [[1], [2, 3, 4]]  # one message for the three, not three


def test_changes_keep_flowing_while_a_later_copy_travels_to_the_same_replica() -> None:
    wire, out = _replaying("b")
    _copy(out, "b")  # the next round's copy: the primary may die before it lands
    assert out.flush(_change(out, 1)) and wire.sent == [("b", [1])]
    _copy(out, "c")  # a new replica host: wait behind its first copy
    assert out.flush(_change(out, 2)) and wire.sent == [("b", [1])]
    assert out.copy_accepted("c") and wire.sent == [("b", [1]), ("c", [2])]


def test_a_failed_send_stops_the_journal_until_the_next_copy() -> None:
    wire, out = _replaying("b")
    wire.down = True
    assert not out.flush(_change(out, 1))
    assert _change(out, 2) == 0  # not sent: one deadline per fault, not one per change
    assert wire.sent == [("b", [1])]
    wire.down = False
    _copy(out, "b")
    _change(out, 3)
    assert out.copy_accepted("b") and wire.sent == [("b", [1]), ("b", [3])]


def test_changes_that_wait_too_long_are_given_up_for_the_next_copy(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(journal, "QUEUE_LIMIT", 2)
    wire = Wire()
    out = JournalOut(wire)
    _copy(out, "b")
    assert _change(out, 1) and _change(out, 2)
    assert _change(out, 3) == 0
    assert out.copy_accepted("b") and wire.sent == []  # that copy is stale now


def test_a_replica_replays_what_follows_its_copy_and_refuses_a_gap() -> None:
    primary = DataShardService(20, 5, 1)
    replica = JournalIn()
    assert not replica.entries([_entry(1)])  # nothing to replay it onto
    replica.copy(DataShardService.from_json(primary.to_json()))
    entries = []
    for worker in ("a", "b", "c"):
        before = primary.seq
        primary.lease(worker)
        entries.append({"term": 0, "from": before, "seq": primary.seq,
                        "op": ["lease", worker]})
    assert replica.entries(entries[:1])
    assert replica.entries(entries[:1])  # a repeat: already applied
    assert not replica.entries(entries[2:])  # entries[1] missed
    assert replica.entries(entries[1:])
    # A late delivery of an older copy changes nothing.
    replica.copy(DataShardService(20, 5, 1))
    held = replica.take()
    assert held is not None and held.to_json() == primary.to_json()
    assert replica.take() is None
