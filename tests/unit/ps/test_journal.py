"""The data-shard service's journal: what a primary sends, queues or stops sending, and
what a replica replays."""

from __future__ import annotations

from ringwright.runtime.ps import journal
from ringwright.runtime.ps.codec import Header
from ringwright.runtime.ps.dataservice import DataShardService
from ringwright.runtime.ps.journal import JournalIn, JournalOut


def _entry(seq: int, term: int = 0) -> Header:
    return {"term": term, "from": seq - 1, "seq": seq, "op": ["lease", f"w{seq}"]}


class Wire:
    """A send that records what it was given and fails while ``down``."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int]] = []
        self.down = False

    def __call__(self, address: str, entry: Header) -> bool:
        self.sent.append((address, int(entry["seq"])))
        return not self.down


def test_changes_queue_behind_a_copy_and_flow_once_it_is_accepted() -> None:
    wire = Wire()
    out = JournalOut(wire)
    assert out.record(_entry(1)) and wire.sent == []  # no copy yet: nowhere to send
    out.copy_taken("b")
    assert out.record(_entry(2)) and out.record(_entry(3)) and wire.sent == []
    assert out.copy_accepted("a") and wire.sent == []  # a copy for another address
    assert out.copy_accepted("b")
    assert wire.sent == [("b", 2), ("b", 3)]
    assert out.record(_entry(4))
    assert wire.sent[-1] == ("b", 4)


def test_changes_keep_flowing_while_a_later_copy_travels_to_the_same_replica() -> None:
    wire = Wire()
    out = JournalOut(wire)
    out.copy_taken("b")
    out.copy_accepted("b")
    out.copy_taken("b")  # the next round's copy: the primary may die before it lands
    assert out.record(_entry(1)) and wire.sent == [("b", 1)]
    out.copy_taken("c")  # a new replica host: queue behind its first copy
    assert out.record(_entry(2)) and wire.sent == [("b", 1)]
    assert out.copy_accepted("c") and wire.sent == [("b", 1), ("c", 2)]


def test_a_failed_send_stops_the_journal_until_the_next_copy() -> None:
    wire = Wire()
    out = JournalOut(wire)
    out.copy_taken("b")
    out.copy_accepted("b")
    wire.down = True
    assert not out.record(_entry(1))
    assert out.record(_entry(2))  # not sent: one deadline per fault, not one per change
    assert wire.sent == [("b", 1)]
    wire.down = False
    out.copy_taken("b")
    out.record(_entry(3))
    assert out.copy_accepted("b") and wire.sent == [("b", 1), ("b", 3)]


def test_a_copy_that_waits_too_long_is_given_up(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(journal, "QUEUE_LIMIT", 2)
    wire = Wire()
    out = JournalOut(wire)
    out.copy_taken("b")
    assert out.record(_entry(1)) and out.record(_entry(2))
    assert not out.record(_entry(3))
    assert out.copy_accepted("b") and wire.sent == []  # that copy is stale now


def test_a_replica_replays_what_follows_its_copy_and_refuses_a_gap() -> None:
    primary = DataShardService(20, 5, 1)
    replica = JournalIn()
    assert not replica.entry(_entry(1))  # nothing to replay it onto
    replica.copy(DataShardService.from_json(primary.to_json()))
    entries = []
    for worker in ("a", "b", "c"):
        before = primary.seq
        primary.lease(worker)
        entries.append({"term": 0, "from": before, "seq": primary.seq,
                        "op": ["lease", worker]})
    assert replica.entry(entries[0])
    assert replica.entry(entries[0])  # a repeat: already applied
    assert not replica.entry(entries[2])  # entries[1] missed
    assert replica.entry(entries[1]) and replica.entry(entries[2])
    # A late delivery of an older copy changes nothing.
    replica.copy(DataShardService(20, 5, 1))
    held = replica.take()
    assert held is not None and held.to_json() == primary.to_json()
    assert replica.take() is None
