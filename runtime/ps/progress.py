"""Is a parameter server making progress? Readiness for PS-mode pods.

A PS is stalled when requests wait on it and none completes for the job's
``stallTimeoutSeconds``: its handler threads are wedged (a deadlock, a hung
optimizer step) although its port still accepts connections. An idle server is not
stalled: nothing waits on it. Progress drives the same :class:`StallWatchdog` and
``/readyz`` endpoint as a worker's training loop, so the operator treats a wedged PS
like a hung worker.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from ..kvlog import runtime_logger
from ..membership.health import StallWatchdog, show_readiness
from ..settings import RuntimeSettings

_log = runtime_logger("ps.server")

UNCOUNTED = frozenset({"Status", "Data"})
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
        self._server = show_readiness(self.watchdog, settings, _log)
        self.watchdog.start()

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> PSReadiness:
        return cls(RuntimeSettings.from_env(environ))

    def close(self) -> None:
        self.watchdog.stop()
        if self._server is not None:
            self._server.stop()
