"""The HTTP key-value store Horovod's gloo controller rendezvouses through.

Horovod (built with gloo) reads ``HOROVOD_GLOO_RENDEZVOUS_ADDR``/``_PORT`` at
``hvd.init()`` and then, per scope, PUTs and polls keys at ``/<scope>/<key>``. This
store answers exactly that: ``PUT`` stores the body, ``GET`` returns it or 404 ("not
yet", which the client polls on), ``DELETE`` is acknowledged and ignored. Replies
always carry ``Content-Length``: Horovod's client truncates bodies without it.

One store serves one world generation and is thrown away afterwards: scope and key names
repeat in every generation, so a reused store would hand a late member the addresses of
the previous generation's peers (see docs/horovod-gloo-notes.md).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_VALUE_BYTES = 1 << 20
"""Largest value accepted; gloo's address blobs are a few hundred bytes per peer."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Every rank polls its peers' keys at ~80 requests/s over new connections.
    request_queue_size = 1024

    def __init__(self, address: str) -> None:
        super().__init__((address, 0), _Handler)
        self.values: dict[str, bytes] = {}
        self.lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: a rendezvous makes dozens of requests per rank."""

    def _reply(self, code: int, body: bytes = b"") -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _key(self) -> str | None:
        # Scope and key, both required: "/global/rank_0".
        parts = self.path.strip("/").split("/")
        return self.path if len(parts) == 2 and all(parts) else None

    def do_GET(self) -> None:
        key = self._key()
        with self.server.lock:
            value = self.server.values.get(key) if key else None
        if value is None:
            self._reply(404)
        else:
            self._reply(200, value)

    def do_PUT(self) -> None:
        key = self._key()
        length = int(self.headers.get("Content-Length") or 0)
        if key is None or length > MAX_VALUE_BYTES:
            self._reply(400)
            return
        body = self.rfile.read(length)
        with self.server.lock:
            self.server.values[key] = body
        self._reply(200)

    def do_DELETE(self) -> None:
        # Horovod announces a finished scope; keys stay until the store is dropped.
        self._reply(200)


class RendezvousStore:
    """A Horovod rendezvous store on ``address`` at a port of the system's choosing.

    ``poll_s`` is how often the server looks for a stop request on its own; :meth:`close`
    does not wait for it.
    """

    def __init__(self, address: str, *, poll_s: float = 0.5) -> None:
        self._server = _Server(address)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(poll_s,),
                                        name="horovod-rendezvous", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        """The address the store listens on."""
        return str(self._server.server_address[0])

    @property
    def port(self) -> int:
        """The port the store listens on."""
        return int(self._server.server_address[1])

    def keys(self) -> list[str]:
        """Every key stored so far, as ``/<scope>/<key>``."""
        with self._server.lock:
            return sorted(self._server.values)

    def close(self) -> None:
        """Stop serving and release the port, without waiting out the server's poll.

        Rank 0 closes the previous generation's store while every member of the next generation
        waits for it at the join barrier: ``serve_forever`` looks at a stop request only
        after a request or at its poll interval (0.5 s, measured as half a second of
        every Horovod recovery), so each wake-up connection makes it look now.
        """
        stopping = threading.Thread(target=self._server.shutdown, daemon=True)
        stopping.start()
        while stopping.is_alive():
            with contextlib.suppress(OSError):
                socket.create_connection((self.address, self.port), timeout=1.0).close()
            stopping.join(0.01)
        self._server.server_close()
        self._thread.join()
