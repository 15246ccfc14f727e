"""The operator's Prometheus metrics: how long reconcile rounds take, how many ran.

One registry per operator (no process-wide globals), served by ``--metrics-port``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

ROUND_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
                 30.0)


class OperatorMetrics:
    """Reconcile rounds (a histogram of their duration) and failed rounds."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.rounds = Histogram(
            "ringwright_reconcile_seconds", "Duration of one observe-plan-apply round.",
            buckets=ROUND_BUCKETS, registry=self.registry)
        self.failed = Counter(
            "ringwright_reconcile_failures", "Rounds that ended in an API error.",
            registry=self.registry)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve ``/metrics`` on ``addr:port`` from a background thread."""
        start_http_server(port, addr=addr, registry=self.registry)
