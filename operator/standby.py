"""The liveness endpoint of a replica that stands by for the leader Lease.

kopf serves ``/healthz`` only once it runs, and a standby replica must not run kopf
(it would act). Until the Lease is ours, this tiny server answers the probe instead,
so the kubelet does not restart a healthy standby.
"""

from __future__ import annotations

import contextlib
import http.server
import threading
import urllib.parse
from collections.abc import Iterator


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"standby": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        return


@contextlib.contextmanager
def standby_health(liveness_url: str) -> Iterator[None]:
    """Answer GETs on ``liveness_url``'s host and port while the block runs ("" : nothing)."""
    if not liveness_url:
        yield
        return
    url = urllib.parse.urlsplit(liveness_url)
    server = http.server.ThreadingHTTPServer((url.hostname or "0.0.0.0", url.port or 80), _Ok)
    thread = threading.Thread(target=server.serve_forever, daemon=True, name="standby-health")
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
