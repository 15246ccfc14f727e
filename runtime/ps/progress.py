"""Is a parameter server making progress? Readiness for PS-mode pods.

A PS is stalled when requests wait on it and none completes for the job's
``stallTimeoutSeconds``: its handler threads are wedged (a deadlock, a hung
optimizer step) although its port still accepts connections. An idle server is not
stalled: nothing waits on it. Progress drives the same :class:`StallWatchdog` and
``/readyz`` endpoint as a worker's training loop, so the operator treats a wedged PS
like a hung worker.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from pathlib import Path

from ..health import HealthFile, ReadinessServer, StallWatchdog
from ..kvlog import log_event, runtime_logger
from ..settings import RuntimeSettings

_log = runtime_logger("ps.server")

UNCOUNTED = frozenset({"Status"})
"""Calls that neither wait nor show progress: a wedged server may still answer them."""


class ServingProgress:
    """Requests in flight on a PS; each completed one is progress."""

    def __init__(self, watchdog: StallWatchdog) -> None:
        self.watchdog = watchdog
        self._lock = threading.Lock()
        self._waiting = 0

    def started(self) -> None:
        with self._lock:
            if self._waiting == 0:
                self.watchdog.beat()  # idle until now: the wait starts here
            self._waiting += 1

    def finished(self) -> None:
        with self._lock:
            self._waiting -= 1
        self.watchdog.beat()

    def tick(self) -> None:
        """Called often by the PS's main loop: idle time is not a stall."""
        with self._lock:
            idle = self._waiting == 0
        if idle:
            self.watchdog.beat()


class PSReadiness:
    """The watchdog of a PS-mode pod and where it shows: health file, ``/readyz``. A PS
    feeds it through :attr:`progress`; a worker beats it at every step."""

    def __init__(self, settings: RuntimeSettings) -> None:
        self.watchdog = StallWatchdog(settings.stall_timeout_s)
        self.progress = ServingProgress(self.watchdog)
        self._server: ReadinessServer | None = None
        if settings.health_file:
            self.watchdog.add_listener(HealthFile(Path(settings.health_file)))
        if settings.readiness_port:
            try:
                self._server = ReadinessServer(self.watchdog, settings.readiness_port,
                                               settings.readiness_address)
            except OSError as err:
                # Serving goes on; the pod stays unready, which a person will see.
                log_event(_log, logging.ERROR, "readiness_unavailable",
                          address=f"{settings.readiness_address}:{settings.readiness_port}",
                          error=err)
            else:
                self._server.start()
        self.watchdog.start()

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> PSReadiness:
        return cls(RuntimeSettings.from_env(environ))

    def close(self) -> None:
        self.watchdog.stop()
        if self._server is not None:
            self._server.stop()
