"""The apply layer's pure parts: a slow-start window that stops at the first refusal, and
events deduplicated into series."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from ringwright.kube import ApiError
from ringwright.objects import Obj
from ringwright.operator.apply.events import EventRecorder
from ringwright.operator.apply.executor import slow_start


class Calls:
    """Records the calls and how many ran at once; refuses the items in ``refuse``."""

    def __init__(self, refuse: set[int] | None = None) -> None:
        self.refuse = refuse or set()
        self.calls: list[int] = []
        self.running = 0
        self.most = 0
        self.order: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def __call__(self, item: int) -> None:
        with self.lock:
            self.calls.append(item)
            self.running += 1
            self.most = max(self.most, self.running)
            self.order.append(("start", item))
        time.sleep(0.001)
        with self.lock:
            self.running -= 1
            self.order.append(("end", item))
        if item in self.refuse:
            raise ApiError(403, "Forbidden", "exceeded quota", "POST pods")


@pytest.fixture()
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(64) as executor:
        yield executor


def test_creates_start_with_one_and_never_exceed_the_cap(pool: ThreadPoolExecutor) -> None:
    calls = Calls()
    done, refusal = slow_start(list(range(300)), calls, pool, cap=16)
    assert (done, refusal) == (300, None)
    assert sorted(calls.calls) == list(range(300))
    # The first create probes alone: a refusing quota costs one request, not a batch.
    assert calls.order[:2] == [("start", 0), ("end", 0)]
    assert 1 < calls.most <= 16


def test_a_slow_create_does_not_hold_back_the_ones_after_it(
        pool: ThreadPoolExecutor) -> None:
    # Batches waited for their slowest call: item 1 returning only once item 20 was sent
    # would never return. The window sends on as other calls succeed.
    later_sent = threading.Event()
    calls = Calls()

    def call(item: int) -> None:
        calls(item)
        if item == 20:
            later_sent.set()
        if item == 1:
            assert later_sent.wait(timeout=30), "item 20 waited for item 1 to return"

    done, refusal = slow_start(list(range(40)), call, pool)
    assert (done, refusal) == (40, None)


class AfterRefusal(ThreadPoolExecutor):
    """Calls after item 5 return only once item 5's refusal is in: what the window does
    next depends on the order of the answers, never on the machine's speed."""

    def __init__(self) -> None:
        super().__init__(64)
        self.refused = threading.Event()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future = super().submit(fn, *args, **kwargs)
        if args[-1] == 5:
            future.add_done_callback(lambda _: self.refused.set())
        return future


def test_a_refusal_stops_the_sending_and_is_returned() -> None:
    calls = Calls(refuse={5})
    with AfterRefusal() as pool:
        def call(item: int) -> None:
            if item > 5:
                assert pool.refused.wait(timeout=30)
            calls(item)

        done, refusal = slow_start(list(range(100)), call, pool)
    assert refusal is not None and refusal.item == 5 and refusal.error.status == 403
    # Nothing goes out once the refusal is seen: five successes open the window to six,
    # so at most five more went out beside item 5.
    assert len(calls.calls) <= 11
    assert done == len(calls.calls) - 1


def test_the_earliest_refused_item_is_the_refusal(pool: ThreadPoolExecutor) -> None:
    calls = Calls(refuse=set(range(3, 100)))
    done, refusal = slow_start(list(range(100)), calls, pool)
    assert done == 3 and refusal is not None and refusal.item == 3


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
