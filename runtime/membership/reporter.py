"""The narrow channel from a pod back to the operator: one report per pod.

Reports say what the API cannot see ("my collective failed in generation G", "I hold no
state", "I am stalled", "I left"). They are best effort: a report that cannot be
delivered is logged and dropped, and never blocks or breaks the training loop.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from ringwright.kube import ApiError, KubeClient, api_path
from ringwright.report_seal import seal, seal_stats
from ringwright.world import MemberStats, Report, ReportKind, stats_key

from ..kvlog import log_event, runtime_logger

_log = runtime_logger("reporter")


class Reporter(Protocol):
    """Sends this pod's latest report to whoever plays the operator."""

    def report(self, kind: ReportKind, generation: int, detail: str = "",
               suspects: Sequence[str] = ()) -> None:
        """Queue a report (``suspects``: pods found dead); returns at once."""
        ...

    def stats(self, stats: MemberStats) -> None:
        """Send this pod's latest measurements (beside its report); returns at once."""
        ...

    def close(self) -> None:
        """Deliver what is queued (briefly) and stop."""
        ...


class LogReporter:
    """Reports as log lines only: for local runs, where the launcher reads exit codes."""

    def __init__(self, pod: str) -> None:
        self._pod = pod

    def report(self, kind: ReportKind, generation: int, detail: str = "",
               suspects: Sequence[str] = ()) -> None:
        """Log the report."""
        log_event(_log, logging.INFO, "report", pod=self._pod, kind=kind.value,
                  generation=generation, suspects=",".join(suspects), detail=detail)

    def stats(self, stats: MemberStats) -> None:
        """Nobody reads them here: the metrics carry the same figures."""

    def close(self) -> None:
        """Nothing buffered."""


class FileReporter:
    """Reports as ``<dir>/<pod>.json``, replaced atomically: the local launcher's channel."""

    def __init__(self, directory: Path, pod: str, *,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._path = directory / f"{pod}.json"
        self._pod = pod
        self._wall = wall_clock
        self._lock = threading.Lock()

    def report(self, kind: ReportKind, generation: int, detail: str = "",
               suspects: Sequence[str] = ()) -> None:
        """Write the report now (a small local file write)."""
        log_event(_log, logging.INFO, "report", pod=self._pod, kind=kind.value,
                  generation=generation, suspects=",".join(suspects), detail=detail)
        text = Report(kind=kind, generation=generation, at=self._wall(), detail=detail[:1000],
                      suspects=tuple(suspects)).to_json()
        self._write(self._path, text, kind.value)

    def stats(self, stats: MemberStats) -> None:
        """Write ``<dir>/<pod>.stats`` now (not ``*.json``: reports are read from those)."""
        self._write(self._path.with_name(stats_key(self._pod)), stats.to_json(), "stats")

    def _write(self, path: Path, text: str, kind: str) -> None:
        with self._lock:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.name}.{os.getpid()}")
                tmp.write_text(text)
                os.replace(tmp, path)
            except OSError as err:
                log_event(_log, logging.WARNING, "report_not_delivered", pod=self._pod,
                          kind=kind, error=err)

    def close(self) -> None:
        """Nothing buffered."""


class KubeReporter:
    """Merge-patches key ``<pod>`` of the job's reports ConfigMap from a sender thread.

    A merge patch touches only this pod's key, so pods never conflict with each
    other and need no read-modify-write. Reports are sealed with ``key``, this pod's
    own report key, so the operator can tell they are this pod's.
    """

    def __init__(
        self,
        client_factory: Callable[[], KubeClient],
        namespace: str,
        configmap: str,
        pod: str,
        *,
        key: str = "",
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._factory = client_factory
        self._key = key
        self._path = api_path("v1", "configmaps", namespace=namespace, name=configmap)
        self._pod = pod
        self._wall = wall_clock
        self._queue: queue.Queue[Report | MemberStats | None] = queue.Queue()
        self._thread = threading.Thread(target=self._send_all, name="ringwright-reporter",
                                        daemon=True)
        self._thread.start()

    def report(self, kind: ReportKind, generation: int, detail: str = "",
               suspects: Sequence[str] = ()) -> None:
        """Queue ``kind`` for delivery; the newest report replaces older ones at the API."""
        log_event(_log, logging.INFO, "report", pod=self._pod, kind=kind.value,
                  generation=generation, suspects=",".join(suspects), detail=detail)
        self._queue.put(Report(kind=kind, generation=generation, at=self._wall(),
                               detail=detail[:1000], suspects=tuple(suspects)))

    def stats(self, stats: MemberStats) -> None:
        """Queue ``stats`` for delivery under ``<pod>.stats``."""
        self._queue.put(stats)

    def close(self, timeout: float = 5.0) -> None:
        """Flush queued reports for up to ``timeout`` seconds, then stop."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _send_all(self) -> None:
        client: KubeClient | None = None
        try:
            while (item := self._queue.get()) is not None:
                if isinstance(item, MemberStats):
                    key, kind = stats_key(self._pod), "stats"
                    text = seal_stats(self._pod, item, self._key).to_json()
                else:
                    key, kind = self._pod, item.kind.value
                    text = seal(self._pod, item, self._key).to_json()
                try:
                    client = client or self._factory()
                    client.merge_patch(self._path, {"data": {key: text}})
                except (ApiError, OSError, ValueError) as err:
                    log_event(_log, logging.WARNING, "report_not_delivered", pod=self._pod,
                              kind=kind, error=err)
                    if client is not None:
                        client.close()
                    client = None
        finally:
            if client is not None:
                client.close()
