"""Rounds read kopf's indices from their own threads while the event loop updates them."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest
from kopf._cogs.structs.references import NamespaceName
from kopf._core.engines.indexing import Store

from ringwright.operator.observe.cache import (
    JOB_CONFIGMAPS,
    NODES,
    POD_SLOTS,
    PODS_BY_JOB,
    POLICIES,
    PRIORITIES,
    IndexCache,
    Written,
    snapshot,
)
from ringwright.operator.observe.ledger import CapacityLedger


@pytest.fixture()
def often_switching() -> Iterator[None]:
    """Threads take turns as often as the interpreter allows."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def key(i: int) -> tuple[NamespaceName, str, str]:
    """kopf's key of one pod in a store: namespace, name, uid."""
    return NamespaceName("ns"), f"p{i}", f"u{i}"


@pytest.mark.usefixtures("often_switching")
def test_a_round_reads_a_jobs_pods_while_their_events_change_the_index() -> None:
    store: Store[dict[str, object]] = Store()
    for i in range(200):
        store._replace(key(i), {"metadata": {"name": f"p{i}"}})
    cache = IndexCache({PODS_BY_JOB: {("ns", "job"): store}, POD_SLOTS: {}, NODES: {},
                        JOB_CONFIGMAPS: {}, POLICIES: {}, PRIORITIES: {}},
                       CapacityLedger(), Written())
    stop = threading.Event()

    def events() -> None:
        # What the pods index does as pods come and go.
        i = 200
        while not stop.is_set():
            store._replace(key(i), {"metadata": {"name": f"p{i}"}})
            store._discard(key(i - 200))
            i += 1

    loop = threading.Thread(target=events)
    loop.start()
    try:
        sizes = {len(cache.job_pods("ns", "job")) for _ in range(3000)}
    finally:
        stop.set()
        loop.join()
    assert sizes <= {199, 200, 201}


class ChangedOnce:
    """A store whose first read meets an update, as a round's read can."""

    def __init__(self, values: list[str]) -> None:
        self.values, self.reads = values, 0

    def __iter__(self) -> Iterator[str]:
        self.reads += 1
        if self.reads == 1:
            raise RuntimeError("dictionary changed size during iteration")
        return iter(self.values)


def test_a_read_that_meets_an_update_is_taken_again() -> None:
    store = ChangedOnce(["a", "b"])
    assert snapshot(store) == ["a", "b"]
    assert store.reads == 2


def test_other_errors_of_a_read_are_not_swallowed() -> None:
    class Broken:
        def __iter__(self) -> Iterator[str]:
            raise RuntimeError("broken")

    with pytest.raises(RuntimeError, match="broken"):
        snapshot(Broken())
