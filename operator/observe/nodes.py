"""The cluster's nodes, kept by a list and a watch of the operator's own.

Not a kopf index: until every index is filled at start-up, kopf makes a readiness toggle
per watched object, and each new toggle wakes the worker of every object still waiting,
which checks every toggle again; so its start-up grows with the cube of the objects
watched (18 s over 2,000 nodes; not done after 3 minutes over 10,000). Nodes are the
many objects an operator of a large cluster watches; a plain informer lists them in
pages and follows one watch, linear in the nodes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ringwright.kube import ApiError, KubeClient
from ringwright.objects import Obj

from .ledger import node_record

log = logging.getLogger("ringwright.operator.observe.nodes")

NODES_PATH = "/api/v1/nodes"
WATCH_SECONDS = 300
"""How long one watch request lasts before it is made again from the last version."""
RETRY_SECONDS = 1.0


class _Expired(Exception):
    """The watch's resourceVersion is too old (410): list again."""


class NodeInformer:
    """Every node's :func:`.ledger.node_record` by name, current as of the last event.

    :attr:`records` maps a name to a one-record tuple (the shape of a kopf index, which
    the capacity ledger reads); it is changed in place, one key at a time, so a round
    reading it from another thread sees each node whole. ``changed`` is told the names
    of the nodes each event changed (the ledger marks them to be looked at again)."""

    def __init__(self, kube: KubeClient, changed: Callable[[set[str]], None]) -> None:
        self.kube, self.changed = kube, changed
        self.records: dict[str, tuple[Obj, ...]] = {}
        self.synced = threading.Event()
        """Set once the first list is in: rounds wait for it (an empty inventory would
        make every job look unschedulable)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """List and watch in a thread of its own (a daemon: it never holds up exit)."""
        self._thread = threading.Thread(target=self.run, name="nodes", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop after the current watch event (or at the watch's end)."""
        self._stop.set()

    def run(self) -> None:
        """List, then follow the watch from the list's version; list again when the
        version expired or the API server could not be reached (after a pause)."""
        while not self._stop.is_set():
            try:
                items, version = self.kube.list_with_version(NODES_PATH)
                self.replace(items)
                self.synced.set()
                while not self._stop.is_set():
                    version = self.follow(self.kube.watch(
                        NODES_PATH, resource_version=version, timeout_seconds=WATCH_SECONDS),
                        version)
            except _Expired:
                continue
            except ApiError as err:
                if err.status == 410:
                    continue
                log.warning("watching nodes failed (listing again in %.0f s): %s",
                            RETRY_SECONDS, err)
                self._stop.wait(RETRY_SECONDS)
            except Exception:  # a bug must not leave the nodes stale for good
                log.exception("the node informer failed; listing again in %.0f s",
                              RETRY_SECONDS)
                self._stop.wait(RETRY_SECONDS)

    def replace(self, nodes: Iterable[Mapping[str, Any]]) -> None:
        """Take a full list: records of nodes not in it go."""
        fresh = {str(n["metadata"]["name"]): (node_record(n),) for n in nodes}
        gone = set(self.records) - set(fresh)
        for name in gone:
            self.records.pop(name, None)
        self.records.update(fresh)
        self.changed(gone | set(fresh))

    def follow(self, events: Iterable[Obj], version: str) -> str:
        """Apply watch ``events``; returns the last resourceVersion seen."""
        for event in events:
            kind = event.get("type")
            obj: Obj = event.get("object") or {}
            if kind == "ERROR":
                if obj.get("code") == 410:
                    raise _Expired()
                raise ApiError(int(obj.get("code") or 0), str(obj.get("reason") or ""),
                               str(obj.get("message") or ""), f"WATCH {NODES_PATH}")
            meta = obj.get("metadata") or {}
            version = str(meta.get("resourceVersion") or version)
            if kind == "BOOKMARK":
                continue
            name = str(meta.get("name") or "")
            if kind == "DELETED":
                self.records.pop(name, None)
            else:
                self.records[name] = (node_record(obj),)
            self.changed({name})
            if self._stop.is_set():
                break
        return version
