"""Stall watchdog and readiness: a hung training loop must make its pod unready.

The training loop calls :meth:`StallWatchdog.beat` on progress. A checker thread
marks the pod unready once no beat came for ``timeout`` seconds; the operator then
drops the pod from the world. Waiting for a new world is not a stall (the pod is
healthy, its peers are not): the group manager beats while it waits alive (polling
for a world, in the join barrier), so only a member hung inside a library call
while forming a group or syncing state turns unready. Nor is work the script declares
long (:meth:`StallWatchdog.paused`, what ``State.busy()`` uses): a long evaluation or a
``torch.compile`` warm-up. Liveness is separate: heartbeats run on their own thread
whatever the watchdog says.

Readiness is exposed as a file (present while ready, for an ``exec`` probe such as
``test -f``) and/or an HTTP endpoint (``/readyz``; ``/healthz`` is liveness and
always answers 200 while the process serves requests).
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ..kvlog import log_event, runtime_logger
from ..settings import RuntimeSettings

_log = runtime_logger("health")

Listener = Callable[[bool, float], None]
"""Called with (ready, seconds since the last progress) on every transition."""


class StallWatchdog:
    """Tracks training progress; ready unless the loop stalled past ``timeout_s``."""

    def __init__(self, timeout_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last = clock()
        self._paused = 0
        """How many :meth:`paused` blocks are open (from any thread)."""
        self._ready = True
        self._listeners: list[Listener] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def ready(self) -> bool:
        """False once the loop has stalled, until it progresses again."""
        with self._lock:
            return self._ready

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener`` on each ready/unready transition (and once now)."""
        self._listeners.append(listener)
        listener(self.ready, 0.0)

    def beat(self) -> None:
        """Record progress (a completed step or commit)."""
        with self._lock:
            self._last = self._clock()
        if not self.ready:
            self.check()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No progress is expected inside, however long it takes: not a stall.

        Entering counts as progress (the loop is evidently alive) and so does leaving:
        the timeout starts again from there. Blocks may nest.
        """
        with self._lock:
            self._paused += 1
        self.beat()
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
            self.beat()

    def check(self) -> bool:
        """Re-evaluate readiness now; notifies listeners on a change."""
        with self._lock:
            idle = self._clock() - self._last
            ready = self.timeout_s <= 0 or self._paused > 0 or idle < self.timeout_s
            changed = ready != self._ready
            self._ready = ready
        if changed:
            log_event(_log, logging.WARNING if not ready else logging.INFO,
                      "readiness_changed", ready=ready, idle_s=idle, timeout_s=self.timeout_s)
            for listener in self._listeners:
                listener(ready, idle)
        return ready

    def start(self, interval_s: float | None = None) -> None:
        """Check in a daemon thread every ``interval_s`` (default: a quarter of the timeout)."""
        if self.timeout_s <= 0 or self._thread is not None:
            return
        every = interval_s if interval_s is not None else min(max(self.timeout_s / 4, 0.05), 5.0)

        def loop() -> None:
            while not self._stop.wait(every):
                self.check()

        self._thread = threading.Thread(target=loop, name="ringwright-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the checker thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


class HealthFile:
    """A file that exists while the pod is ready (a listener for the watchdog)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, ready: bool, idle_s: float) -> None:
        """Create the file when ready, remove it when stalled."""
        if ready:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            tmp.write_text("ready\n")
            os.replace(tmp, self.path)
        else:
            self.path.unlink(missing_ok=True)


class ReadinessServer:
    """``GET /readyz`` (200 ready, 503 stalled) and ``GET /healthz`` over HTTP."""

    def __init__(self, watchdog: StallWatchdog, port: int, host: str = "0.0.0.0") -> None:
        dog = watchdog

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/healthz":
                    code, body = 200, b"ok\n"
                elif self.path == "/readyz":
                    ready = dog.ready
                    code, body = (200, b"ready\n") if ready else (503, b"stalled\n")
                else:
                    code, body = 404, b"not found\n"
                self.send_response(code)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                # Probes hit this every few seconds; access logs would drown the training log.
                return

        self._server = http.server.ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="ringwright-readiness", daemon=True)

    def start(self) -> None:
        """Serve in a daemon thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()


def show_readiness(watchdog: StallWatchdog, settings: RuntimeSettings,
                   logger: logging.Logger) -> ReadinessServer | None:
    """Make ``watchdog``'s verdict visible as the pod's settings ask: the health file
    and the ``/readyz`` server (started; None when not asked for or its port is taken,
    logged: the work goes on and the pod stays unready, which a person will see)."""
    if settings.health_file:
        watchdog.add_listener(HealthFile(Path(settings.health_file)))
    if not settings.readiness_port:
        return None
    try:
        server = ReadinessServer(watchdog, settings.readiness_port, settings.readiness_address)
    except OSError as err:
        log_event(logger, logging.ERROR, "readiness_unavailable",
                  address=f"{settings.readiness_address}:{settings.readiness_port}",
                  error=err)
        return None
    server.start()
    return server
