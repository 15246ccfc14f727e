"""Serve a Prometheus registry over HTTP (``/metrics``); shared by operator and runtime."""

from __future__ import annotations

from dataclasses import dataclass
from threading import Thread
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server


@dataclass(frozen=True)
class MetricsEndpoint:
    """A running exposition server; ``port`` is the bound one (useful with port 0)."""

    server: WSGIServer
    thread: Thread

    @property
    def port(self) -> int:
        """The TCP port the server listens on."""
        return int(self.server.server_port)

    def stop(self) -> None:
        """Stop serving and release the port."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def serve(registry: CollectorRegistry, port: int, address: str = "0.0.0.0") -> MetricsEndpoint:
    """Serve ``registry`` on ``address:port`` from a daemon thread."""
    server, thread = start_http_server(port, addr=address, registry=registry)
    return MetricsEndpoint(server, thread)
