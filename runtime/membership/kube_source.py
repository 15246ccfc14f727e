"""Membership from the job's world ConfigMap, through a real Kubernetes watch.

A background thread lists the one ConfigMap (by field selector, to learn a
resourceVersion), then streams a watch from that version. When the server ends the
watch it resumes from the last version seen; when the version has expired (410 Gone)
it lists again; on network or API errors it backs off and reconnects with a fresh
client, which also picks up a rotated ServiceAccount token.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ringwright.kube import ApiError, KubeClient, api_path
from ringwright.world import WORLD_KEY, ContractError, World, parse_world

from ..kvlog import log_event, runtime_logger
from .source import WorldBox

_log = runtime_logger("kube_source")

GONE = 410


class _Expired(Exception):
    """The watch's resourceVersion is too old; list again."""


class KubeMembershipSource:
    """Follows ``<namespace>/<configmap>`` key ``world.json`` with list + watch."""

    def __init__(
        self,
        client_factory: Callable[[], KubeClient],
        namespace: str,
        configmap: str,
        *,
        watch_timeout_s: int = 300,
        initial_backoff_s: float = 0.2,
        max_backoff_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._factory = client_factory
        self._namespace = namespace
        self._name = configmap
        self._watch_timeout = watch_timeout_s
        self._initial_backoff = initial_backoff_s
        self._max_backoff = max_backoff_s
        self._box = WorldBox(clock)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._client: KubeClient | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"ringwright-watch-{configmap}", daemon=True
        )
        self._thread.start()

    @property
    def where(self) -> str:
        """``namespace/name`` of the watched ConfigMap, for messages."""
        return f"{self._namespace}/{self._name}"

    def latest(self) -> World | None:
        """The newest world received from the API server."""
        return self._box.latest()

    def wait_for_world(self, after_generation: int, timeout: float) -> World:
        """Block until the watch delivers a world newer than ``after_generation``."""
        return self._box.wait_newer(after_generation, timeout)

    def close(self) -> None:
        """Stop watching. A read blocked on a quiet watch stream cannot be interrupted
        from another thread, so the (daemon) thread is not waited for long: it ends at
        the stream's next event or server-side timeout."""
        self._stop.set()
        with self._lock:
            if self._client is not None:
                self._client.close()
        self._thread.join(timeout=0.5)

    def _run(self) -> None:
        backoff = self._initial_backoff
        while not self._stop.is_set():
            client = self._factory()
            with self._lock:
                self._client = client
            try:
                version = self._list(client)
                backoff = self._initial_backoff
                while not self._stop.is_set():
                    version = self._watch(client, version)
            except _Expired:
                log_event(_log, logging.INFO, "watch_expired", configmap=self.where)
            except (ApiError, OSError, ValueError, RuntimeError) as err:
                # RuntimeError: close() closed the client under a request about to start.
                if self._stop.is_set():
                    return
                log_event(_log, logging.WARNING, "watch_failed", configmap=self.where,
                          error=err, retry_in_s=backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self._max_backoff)
            finally:
                with self._lock:
                    self._client = None
                client.close()

    def _path(self) -> str:
        return api_path("v1", "configmaps", namespace=self._namespace)

    def _selector(self) -> str:
        return f"metadata.name={self._name}"

    def _list(self, client: KubeClient) -> str:
        doc = client.get(self._path(), fieldSelector=self._selector())
        for item in doc.get("items") or []:
            self._take(item)
        version: str = (doc.get("metadata") or {}).get("resourceVersion", "")
        return version

    def _watch(self, client: KubeClient, version: str) -> str:
        try:
            events = client.watch(
                self._path(),
                resource_version=version,
                timeout_seconds=self._watch_timeout,
                fieldSelector=self._selector(),
            )
            for event in events:
                version = self._handle(event, version)
        except ApiError as err:
            if err.status == GONE:
                raise _Expired from err
            raise
        return version

    def _handle(self, event: dict[str, Any], version: str) -> str:
        kind = event.get("type", "")
        obj: dict[str, Any] = event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == GONE:
                raise _Expired
            raise ApiError(int(obj.get("code") or 500), str(obj.get("reason", "")),
                           str(obj.get("message", "")), f"WATCH {self.where}")
        new_version: str = (obj.get("metadata") or {}).get("resourceVersion", "") or version
        if kind in ("ADDED", "MODIFIED"):
            self._take(obj)
        elif kind == "DELETED":
            log_event(_log, logging.WARNING, "world_configmap_deleted", configmap=self.where)
        return new_version

    def _take(self, configmap: dict[str, Any]) -> None:
        text = (configmap.get("data") or {}).get(WORLD_KEY)
        if not text:
            return
        try:
            world = parse_world(text, where=self.where)
        except ContractError as err:
            # Keep the last good world: the operator will publish a fixed one.
            log_event(_log, logging.ERROR, "world_unreadable", configmap=self.where, error=err)
            return
        self._box.offer(world, self.where)
