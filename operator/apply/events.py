"""Kubernetes Events on a job, deduplicated into series as client-go's recorder does.

The same (type, reason, message) on the same job within ``series_seconds`` bumps the
existing Event's ``count`` and ``lastTimestamp`` instead of creating another object, so
a job that stays unschedulable for an hour leaves one Event, not 360.

A Warning is one series per reason: a repeat whose message changed (a refusal that
names another pod, a count that moved) bumps the same Event and updates its message,
so a condition that persists through every resync never makes a new Warning. Normal
events keep one series per message: each tells a step of the job's story (generation 3,
then generation 4) that must stay readable.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ringwright.kube import ApiError, api_path
from ringwright.objects import Obj

from ..api.conditions import rfc3339

log = logging.getLogger("ringwright.operator.apply.events")

COMPONENT = "ringwright-operator"


class EventWriter(Protocol):
    """The two calls the recorder makes (a :class:`KubeClient` is one)."""

    def create(self, path: str, body: Obj) -> Obj:
        """POST ``body`` into the collection at ``path``."""
        ...

    def merge_patch(self, path: str, body: Obj) -> Obj:
        """Merge-patch the object at ``path``."""
        ...


@dataclass
class _Series:
    name: str
    count: int
    last: float


class EventRecorder:
    """Records Events on objects; repeats become one series. Safe to share between threads."""

    def __init__(self, kube: EventWriter, clock: Callable[[], float], *,
                 series_seconds: float = 3600.0, remembered: int = 4096) -> None:
        self.kube, self.clock = kube, clock
        self.series_seconds, self.remembered = series_seconds, remembered
        self.instance = socket.gethostname()
        self._series: OrderedDict[tuple[str, str, str, str], _Series] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, obj: Obj, type_: str, reason: str, message: str) -> None:
        """Record one Event on ``obj``; never raises (an event is not worth a failed round)."""
        meta = obj["metadata"]
        message = message[:1000]
        key = (str(meta.get("uid", "")), type_, reason, "" if type_ == "Warning" else message)
        now = self.clock()
        with self._lock:
            series = self._series.get(key)
            if series is not None and now - series.last < self.series_seconds:
                series.count += 1
                series.last = now
                self._series.move_to_end(key)
            else:
                series = None
        try:
            if series is not None:
                self.kube.merge_patch(
                    api_path("v1", "events", meta["namespace"], series.name),
                    {"count": series.count, "lastTimestamp": rfc3339(now), "message": message})
                return
            created = self.kube.create(api_path("v1", "events", meta["namespace"]),
                                       self._body(obj, type_, reason, message, now))
        except ApiError as err:
            log.warning("could not record event %s: %s", reason, err)
            with self._lock:
                self._series.pop(key, None)  # start a fresh series next time
            return
        with self._lock:
            self._series[key] = _Series(created["metadata"]["name"], 1, now)
            while len(self._series) > self.remembered:
                self._series.popitem(last=False)

    def _body(self, obj: Obj, type_: str, reason: str, message: str, now: float) -> Obj:
        meta = obj["metadata"]
        stamp = rfc3339(now)
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": obj["apiVersion"], "kind": obj["kind"],
                               "name": meta["name"], "namespace": meta["namespace"],
                               "uid": meta.get("uid", "")},
            "type": type_,
            "reason": reason,
            "message": message,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.instance,
        }
