"""Prometheus metrics of a parameter-server job: each PS's pushes and pulls, and each
worker's steps, served on the pod's metrics port.

The server core reports every push's verdict and every pull (:meth:`PSMetrics.pushed`,
:meth:`PSMetrics.pulled`); a worker reports each step's outcome
(:meth:`PSMetrics.worker_step`). Both keep their own counters for logs and reports:
these are the exported view, in a registry of their own.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram

from ringwright.exposition import MetricsEndpoint, serve

from ..kvlog import log_event, runtime_logger
from ..settings import RuntimeSettings
from .serving.consistency import Verdict

_log = runtime_logger("ps.metrics")

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
"""Versions behind: bounded-staleness async keeps them under its tau."""


class PSMetrics:
    """One PS or PS worker process's metrics."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        p = "ringwright_ps_"
        self.pushes = Counter(f"{p}pushes", "Gradient pushes received, by shard and verdict "
                              "(apply, buffer, stale, duplicate).", ["shard", "verdict"],
                              registry=r)
        self.pulls = Counter(f"{p}pulls", "Parameter pulls served, by shard.", ["shard"],
                             registry=r)
        self.staleness = Histogram(f"{p}push_staleness", "Versions behind the shard of "
                                   "each push whose gradients were applied.",
                                   buckets=STALENESS_BUCKETS, registry=r)
        self.stale_dropped = Counter(f"{p}stale_gradients_dropped", "Pushes dropped as "
                                     "too stale, by shard.", ["shard"], registry=r)
        self.worker_steps = Counter(f"{p}worker_steps", "Steps trained by this worker.",
                                    registry=r)
        self.worker_dropped = Counter(f"{p}worker_steps_dropped", "Steps of this worker "
                                      "whose push a PS dropped as too stale.", registry=r)

    def pushed(self, shard: int, verdict: Verdict, staleness: int, *, skip: bool) -> None:
        """A PS judged one push; ``skip`` pushes carry no gradient (only round counts)."""
        self.pushes.labels(str(shard), verdict.value).inc()
        if skip:
            return
        if verdict is Verdict.STALE:
            self.stale_dropped.labels(str(shard)).inc()
        elif verdict is not Verdict.DUPLICATE:
            self.staleness.observe(staleness)

    def pulled(self, shard: int) -> None:
        """A PS served one pull of ``shard``."""
        self.pulls.labels(str(shard)).inc()

    def worker_step(self, *, dropped: bool) -> None:
        """A worker finished a step; ``dropped`` when its push was dropped as stale."""
        self.worker_steps.inc()
        if dropped:
            self.worker_dropped.inc()


def serve_from_env(metrics: PSMetrics, environ: Mapping[str, str]) -> MetricsEndpoint | None:
    """Serve ``metrics`` where the operator asks (``RINGWRIGHT_METRICS_PORT`` on the
    pod's IP), as the elastic runtime does; None when no port is set. A port that cannot
    be bound is logged, not fatal: training matters more than its metrics."""
    settings = RuntimeSettings.from_env(environ)
    if not settings.metrics_port:
        return None
    try:
        return serve(metrics.registry, settings.metrics_port, settings.metrics_address)
    except OSError as err:
        log_event(_log, logging.WARNING, "metrics_not_served", port=settings.metrics_port,
                  address=settings.metrics_address, error=err)
        return None
