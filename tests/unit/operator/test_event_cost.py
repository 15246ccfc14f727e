"""What kopf does per watch event stays cheap: indices are filled in the event loop (no
thread hand-off per object per event), no diff base is copied from every object, and the
pods index keeps the event's objects instead of a deep copy."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, cast

import kopf

from ringwright.objects import Obj
from ringwright.operator.handlers import NoDiffBase, register
from ringwright.operator.observe.cache import PODS_BY_JOB
from ringwright.operator.plan.manifests import JOB_LABEL


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
                  if h.activity is not None and h.activity.value == "startup"
                  and getattr(h.fn, "__name__", "") == "configure"]
    configure: Callable[..., object] = startup.fn
    configure(settings=settings)
    storage = settings.persistence.diffbase_storage
    assert isinstance(storage, NoDiffBase)
    pod = kopf.Body({"metadata": {"name": "p", "labels": {"a": "b"}},
                     "spec": {"containers": [{"name": "c", "env": [{"name": "X"}] * 50}]}})
    assert storage.build(body=pod) == storage.fetch(body=pod) == {}


def test_the_pods_index_keeps_the_events_objects_without_a_deep_copy() -> None:
    (index,) = [h for h in registry()._indexing.get_all_handlers() if h.id == PODS_BY_JOB]
    labels = {JOB_LABEL: "j"}
    raw: Obj = {"metadata": {"name": "j-worker-0", "namespace": "ns", "labels": labels},
                "spec": {"containers": [{"name": "c", "env": [{"name": "X"}] * 50}]},
                "status": {"phase": "Pending"}}
    fn: Callable[..., Coroutine[Any, Any, dict[tuple[str, str], Obj]]] = cast(Any, index.fn)
    entry = asyncio.run(fn(namespace="ns", labels=labels,
                           body=kopf.Body(cast(kopf.RawBody, raw))))[("ns", "j")]
    assert entry == raw
    assert entry["spec"] is raw["spec"] and entry["status"] is raw["status"]
