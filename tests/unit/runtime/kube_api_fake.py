"""A faithful fake of the slice of the Kubernetes API the runtime uses.

It serves ConfigMaps in one namespace over HTTP/1.1 with bearer-token auth:
list with a field selector (returning the list's resourceVersion), watch streams in
chunked encoding that replay events after a resourceVersion and then follow new ones,
``timeoutSeconds`` ending a watch, ``410 Gone`` for a version older than the
compacted history, and JSON merge patch. Tests can expire history, cut open watch
connections, and inspect every request.
"""

from __future__ import annotations

import copy
import http.server
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

from ringwright.objects import Obj


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    body: Obj | None = None


@dataclass
class _Store:
    cond: threading.Condition = field(default_factory=threading.Condition)
    version: int = 100
    objects: dict[str, Obj] = field(default_factory=dict)
    events: list[tuple[int, str, Obj]] = field(default_factory=list)
    compacted: int = 0
    """Watches from a version below this get 410 Gone."""
    cut: int = 0
    """Bumped to make every open watch drop its connection."""


class FakeKubeApi:
    """Run with ``with FakeKubeApi(namespace, token) as api:``; ``api.url`` to connect."""

    def __init__(self, namespace: str, token: str) -> None:
        self.namespace = namespace
        self.token = token
        self.requests: list[Request] = []
        self._store = _Store()
        self._server = _QuietServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeKubeApi:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cut_watches()
        self._server.shutdown()
        self._server.server_close()

    # Controls for tests.

    def put_configmap(self, name: str, data: dict[str, str]) -> None:
        """Create or replace a ConfigMap (an ADDED or MODIFIED event)."""
        s = self._store
        with s.cond:
            kind = "MODIFIED" if name in s.objects else "ADDED"
            self._record(kind, {"metadata": {"name": name, "namespace": self.namespace},
                                "data": dict(data)})

    def delete_configmap(self, name: str) -> None:
        s = self._store
        with s.cond:
            obj = s.objects.pop(name)
            self._record("DELETED", obj, keep=False)

    def configmap(self, name: str) -> Obj | None:
        with self._store.cond:
            obj = self._store.objects.get(name)
            return copy.deepcopy(obj) if obj else None

    def compact(self) -> None:
        """Forget history: watching from any version seen so far now yields 410 Gone."""
        s = self._store
        with s.cond:
            s.compacted = s.version + 1
            s.cond.notify_all()

    def cut_watches(self) -> None:
        """Drop every open watch connection without ending the chunked stream."""
        s = self._store
        with s.cond:
            s.cut += 1
            s.cond.notify_all()

    def watches(self) -> list[Request]:
        return [r for r in list(self.requests) if r.query.get("watch") == "1"]

    def _record(self, kind: str, obj: Obj, keep: bool = True) -> None:
        s = self._store
        s.version += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(s.version)
        if keep:
            s.objects[obj["metadata"]["name"]] = obj
        s.events.append((s.version, kind, obj))
        s.cond.notify_all()

    # The server.

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                return

            def do_GET(self) -> None:
                api._serve(self, "GET")

            def do_PATCH(self) -> None:
                api._serve(self, "PATCH")

        return Handler

    def _serve(self, h: http.server.BaseHTTPRequestHandler, method: str) -> None:
        url = urllib.parse.urlsplit(h.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        body: Obj | None = None
        if method == "PATCH":
            length = int(h.headers.get("Content-Length", "0"))
            body = json.loads(h.rfile.read(length)) if length else None
        self.requests.append(Request(method, url.path, query, body))
        if h.headers.get("Authorization") != f"Bearer {self.token}":
            return _reply(h, 401, _status(401, "Unauthorized", "bad token"))
        base = f"/api/v1/namespaces/{self.namespace}/configmaps"
        if method == "GET" and url.path == base:
            name = query.get("fieldSelector", "").removeprefix("metadata.name=")
            if query.get("watch") == "1":
                return self._watch(h, name, query)
            return self._list(h, name)
        if method == "PATCH" and url.path.startswith(base + "/"):
            if h.headers.get("Content-Type") != "application/merge-patch+json":
                return _reply(h, 415, _status(415, "UnsupportedMediaType", "merge patch only"))
            return self._patch(h, url.path.removeprefix(base + "/"), body or {})
        return _reply(h, 404, _status(404, "NotFound", url.path))

    def _list(self, h: http.server.BaseHTTPRequestHandler, name: str) -> None:
        s = self._store
        with s.cond:
            items = [copy.deepcopy(o) for n, o in s.objects.items() if n == name]
            doc = {"kind": "ConfigMapList", "metadata": {"resourceVersion": str(s.version)},
                   "items": items}
        _reply(h, 200, doc)

    def _patch(self, h: http.server.BaseHTTPRequestHandler, name: str, patch: Obj) -> None:
        s = self._store
        with s.cond:
            obj = s.objects.get(name)
            if obj is None:
                return _reply(h, 404, _status(404, "NotFound", f"configmaps {name!r}"))
            merged = copy.deepcopy(obj)
            merged.setdefault("data", {}).update(patch.get("data") or {})
            self._record("MODIFIED", merged)
            result = copy.deepcopy(s.objects[name])
        _reply(h, 200, result)

    def _watch(self, h: http.server.BaseHTTPRequestHandler, name: str,
               query: dict[str, str]) -> None:
        s = self._store
        since = int(query.get("resourceVersion") or 0)
        deadline = time.monotonic() + float(query.get("timeoutSeconds", "1800"))
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        with s.cond:
            cut = s.cut
        try:
            while True:
                with s.cond:
                    if s.cut != cut:
                        h.close_connection = True
                        return
                    if since < s.compacted:
                        _chunk(h, {"type": "ERROR",
                                   "object": _status(410, "Expired", "too old resource version")})
                        break
                    pending = [(v, k, o) for v, k, o in s.events
                               if v > since and o["metadata"]["name"] == name]
                    if not pending:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        s.cond.wait(min(left, 0.5))
                        continue
                for version, kind, obj in pending:
                    _chunk(h, {"type": kind, "object": obj})
                    since = version
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            h.close_connection = True


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        # Clients hanging up mid-stream is what several tests do on purpose.
        return


def _status(code: int, reason: str, message: str) -> Obj:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
            "reason": reason, "message": message}


def _reply(h: http.server.BaseHTTPRequestHandler, code: int, doc: Obj) -> None:
    data = json.dumps(doc).encode()
    h.send_response(code)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    h.wfile.write(data)


def _chunk(h: http.server.BaseHTTPRequestHandler, event: Obj) -> None:
    data = (json.dumps(event) + "\n").encode()
    h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    h.wfile.flush()
