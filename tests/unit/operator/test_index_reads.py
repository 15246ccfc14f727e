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
