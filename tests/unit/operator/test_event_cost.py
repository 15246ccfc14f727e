"""What kopf does per watch event stays cheap: indices are filled in the event loop (no
thread hand-off per object per event), and no diff base is copied from every object."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import kopf

from ringwright.operator.handlers import NoDiffBase, register


def registry() -> kopf.OperatorRegistry:
    reg = kopf.OperatorRegistry()
    register(reg)
    return reg


def test_every_index_handler_runs_in_the_event_loop() -> None:
    handlers = registry()._indexing.get_all_handlers()
    assert len(handlers) >= 6
    # kopf runs a plain function in its thread pool; only a coroutine runs in place.
    threaded = [h.id for h in handlers if not asyncio.iscoroutinefunction(h.fn)]
    assert threaded == []


def test_kopf_keeps_no_diff_base_and_nothing_would_read_one() -> None:
    reg = registry()
    # The diff base feeds on.create/update/delete/resume/field handlers only.
    assert list(reg._changing.get_all_handlers()) == []
    settings = kopf.OperatorSettings()
    (startup,) = [h for h in reg._activities.get_all_handlers()
                  if h.activity is not None and h.activity.value == "startup"]
    configure: Callable[..., object] = startup.fn
    configure(settings=settings)
    storage = settings.persistence.diffbase_storage
    assert isinstance(storage, NoDiffBase)
    pod = kopf.Body({"metadata": {"name": "p", "labels": {"a": "b"}},
                     "spec": {"containers": [{"name": "c", "env": [{"name": "X"}] * 50}]}})
    assert storage.build(body=pod) == storage.fetch(body=pod) == {}
