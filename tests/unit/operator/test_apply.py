"""The apply layer's pure parts: slow-start batches that stop at the first refusal, and
events deduplicated into series."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pytest

from ringwright.kube import ApiError
from ringwright.objects import Obj
from ringwright.operator.apply.events import EventRecorder
from ringwright.operator.apply.executor import slow_start

T = TypeVar("T")


class Batches:
    """Records how many calls ran at once, by batch."""

    def __init__(self, refuse: set[int] | None = None) -> None:
        self.refuse = refuse or set()
        self.calls: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, item: int) -> None:
        with self.lock:
            self.calls.append(item)
        if item in self.refuse:
            raise ApiError(403, "Forbidden", "exceeded quota", "POST pods")


class RecordingPool(ThreadPoolExecutor):
    """A real thread pool that notes the size of every batch handed to ``map``."""

    def __init__(self) -> None:
        super().__init__(64)
        self.batches: list[int] = []

    def map(self, fn: Callable[..., T], *iterables: Iterable[Any], timeout: float | None = None,
            chunksize: int = 1) -> Iterator[T]:
        items = list(iterables[0])
        self.batches.append(len(items))
        return super().map(fn, items, timeout=timeout, chunksize=chunksize)


@pytest.fixture()
def pool() -> RecordingPool:
    return RecordingPool()


def test_creates_go_out_in_batches_of_1_2_4_up_to_the_cap(pool: RecordingPool) -> None:
    calls = Batches()
    done, refusal = slow_start(list(range(300)), calls, pool, cap=64)
    assert (done, refusal) == (300, None)
    assert sorted(calls.calls) == list(range(300))
    assert pool.batches == [1, 2, 4, 8, 16, 32, 64, 64, 64, 45]


def test_a_refusal_ends_the_batch_it_is_in_and_nothing_after_is_sent(
        pool: RecordingPool) -> None:
    calls = Batches(refuse={5})  # item 5 is in the third batch (items 3..6)
    done, refusal = slow_start(list(range(100)), calls, pool)
    assert refusal is not None and refusal.item == 5 and refusal.error.status == 403
    assert sorted(calls.calls) == list(range(7))  # batches 1, 2, 4 and no further
    assert done == 6 and pool.batches == [1, 2, 4]


class Writes:
    def __init__(self) -> None:
        self.created: list[Obj] = []
        self.patched: list[tuple[str, Obj]] = []

    def create(self, path: str, body: Obj) -> Obj:
        self.created.append(body)
        return {"metadata": {"name": f"ev-{len(self.created)}"}}

    def merge_patch(self, path: str, body: Obj) -> Obj:
        self.patched.append((path, body))
        return {}


JOB: Obj = {"apiVersion": "ringwright.dev/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": "j", "namespace": "a", "uid": "u"}}


def test_repeated_events_become_one_series_with_a_count() -> None:
    writes, now = Writes(), [1000.0]
    events = EventRecorder(writes, lambda: now[0], series_seconds=600)
    for _ in range(3):
        events.record(JOB, "Warning", "Unschedulable", "needs 8 GPUs")
        now[0] += 10
    events.record(JOB, "Normal", "WorldPublished", "generation 1")
    assert [e["reason"] for e in writes.created] == ["Unschedulable", "WorldPublished"]
    assert [(p, b["count"]) for p, b in writes.patched] == [
        ("/api/v1/namespaces/a/events/ev-1", 2), ("/api/v1/namespaces/a/events/ev-1", 3)]


def test_a_warning_is_one_series_per_reason_whatever_its_message() -> None:
    writes, now = Writes(), [1000.0]
    events = EventRecorder(writes, lambda: now[0], series_seconds=600)
    for i in range(5):  # a refusal that names another pod on every resync
        events.record(JOB, "Warning", "FailedCreate", f"create Pod j-worker-{i}: quota")
        now[0] += 10
    assert [e["reason"] for e in writes.created] == ["FailedCreate"]
    assert [b["count"] for _, b in writes.patched] == [2, 3, 4, 5]
    assert writes.patched[-1][1]["message"] == "create Pod j-worker-4: quota"
    # Normal events stay one per message: each is a step of the story.
    events.record(JOB, "Normal", "WorldPublished", "generation 1")
    events.record(JOB, "Normal", "WorldPublished", "generation 2")
    assert [e["message"] for e in writes.created[1:]] == ["generation 1", "generation 2"]


def test_a_series_older_than_its_window_starts_a_new_event() -> None:
    writes, now = Writes(), [1000.0]
    events = EventRecorder(writes, lambda: now[0], series_seconds=60)
    events.record(JOB, "Warning", "Unschedulable", "needs 8 GPUs")
    now[0] += 61
    events.record(JOB, "Warning", "Unschedulable", "needs 8 GPUs")
    assert len(writes.created) == 2 and not writes.patched
