"""The data-shard service keeps exact accounting while workers come, go and die."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from ringwright.runtime.ps.data.service import DataShardService, LeaseStatus

ops = st.lists(st.tuples(st.sampled_from(["lease", "batch", "drop", "leave"]),
                         st.integers(0, 3), st.integers(1, 7)), max_size=120)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 60), st.integers(1, 13), st.integers(1, 3), st.booleans(), ops)
def test_every_sample_is_trained_or_dropped_exactly_once(
        samples: int, piece: int, epochs: int, requeue: bool,
        steps: list[tuple[str, int, int]]) -> None:
    svc = DataShardService(samples, piece, epochs, requeue_stale=requeue)
    trained: Counter[tuple[int, int]] = Counter()
    dropped: Counter[tuple[int, int]] = Counter()
    held: dict[str, list[int]] = {}  # worker -> [piece, epoch, next, stop]

    def work(worker: str, size: int, drop: bool) -> None:
        lease = held.get(worker)
        if lease is None:
            return
        pid, epoch, start, stop = lease
        end = min(stop, start + size)
        assert svc.report(worker, pid, start, end, dropped=drop)
        for i in range(start, end):
            (dropped if drop else trained)[(epoch, i)] += 1
        if end == stop:
            del held[worker]
        else:
            lease[2] = end

    def take(worker: str) -> LeaseStatus:
        got = svc.lease(worker)
        if got.status is LeaseStatus.GRANTED:
            held[worker] = [got.piece, got.epoch, got.start, got.stop]
        return got.status

    for op, w, size in steps:
        worker = f"w{w}"
        if op == "lease" and worker not in held:
            take(worker)
        elif op in ("batch", "drop"):
            work(worker, size, op == "drop")
        elif op == "leave":
            if worker in held:
                # A stale report from the worker given up on is refused.
                pid, _, start, stop = held.pop(worker)
                svc.release(worker)
                assert not svc.report(worker, pid, start, stop, dropped=False)
            else:
                svc.release(worker)
    for worker in list(held):
        svc.release(worker)
        del held[worker]
    # One worker drains what is left.
    while take("last") is not LeaseStatus.DONE:
        while "last" in held:
            work("last", 5, False)
    for epoch in range(epochs):
        for i in range(samples):
            key = (epoch, i)
            if requeue:
                assert trained[key] == 1, key
            else:
                assert trained[key] + dropped[key] == 1, key
        assert svc.accounting.trained.get(epoch, 0) == sum(
            n for (e, _), n in trained.items() if e == epoch)
        assert svc.accounting.dropped.get(epoch, 0) == sum(
            n for (e, _), n in dropped.items() if e == epoch)
        # Re-queued after a drop exactly when the switch is on.
        assert svc.accounting.requeued_stale.get(epoch, 0) == (
            svc.accounting.dropped.get(epoch, 0) if requeue else 0)


def test_roundtrip_through_json_keeps_the_queue() -> None:
    svc = DataShardService(10, 3, 2)
    a = svc.lease("a")
    svc.report("a", a.piece, a.start, a.start + 1, dropped=False)
    copy = DataShardService.from_json(svc.to_json())
    assert copy.to_json() == svc.to_json()
    copy.release("a")
    again = copy.lease("b")
    assert (again.piece, again.start, again.stop) == (a.piece, a.start + 1, a.stop)


def test_wait_until_others_finish_the_epoch() -> None:
    svc = DataShardService(4, 4, 2)
    a = svc.lease("a")
    assert svc.lease("b").status is LeaseStatus.WAIT
    svc.report("a", a.piece, 0, 4, dropped=False)
    assert svc.lease("b").epoch == 1


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 9), st.integers(1, 3), st.booleans(), ops)
def test_a_replica_replaying_the_changes_holds_exactly_the_primarys_queue(
        samples: int, piece: int, epochs: int, requeue: bool,
        steps: list[tuple[str, int, int]]) -> None:
    primary = DataShardService(samples, piece, epochs, requeue_stale=requeue)
    replica = DataShardService.from_json(primary.to_json())
    for op, w, size in steps:
        worker = f"w{w}"
        change: list[object]
        if op == "lease":
            change = ["lease", worker]
        elif op == "leave":
            change = ["release", worker]
        else:
            got = primary.lease(worker)  # the piece held, or a new one
            replica.perform(["lease", worker])
            if got.status is not LeaseStatus.GRANTED:
                continue
            change = ["report", worker, got.piece, got.start, min(got.stop, got.start + size),
                      op == "drop"]
        before = primary.seq
        primary.perform(change)
        if primary.seq != before:  # only changes are journaled
            replica.perform(change)
        assert replica.to_json() == primary.to_json()


def test_a_retried_report_or_lease_changes_nothing() -> None:
    svc = DataShardService(10, 5, 1)
    a = svc.lease("a")
    assert svc.lease("a") == a  # the answer was lost: the same piece
    assert svc.report("a", a.piece, 0, 2, dropped=False)
    seq = svc.seq
    assert svc.report("a", a.piece, 0, 2, dropped=False)  # a retry: accepted, not counted
    assert (svc.seq, svc.accounting.trained) == (seq, {0: 2})
    assert not svc.report("a", a.piece, 1, 3, dropped=False)  # not a batch it reported
    again = svc.lease("a")
    assert (again.piece, again.start, again.stop) == (a.piece, 2, 5)
    assert not svc.report("b", a.piece, 2, 5, dropped=False)  # not b's lease
