"""The typed helper over the official client: credentials (token file, exec plugin) re-read
on 401, 429/5xx retried after Retry-After, lists paged, watches streamed and cut by close().

The server is a scripted HTTP fake: each request gets the next queued answer and is
recorded with its headers, so the tests read exactly what the client sent.
"""

from __future__ import annotations

import http.server
import json
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ringwright.kube import (
    LIST_PAGE_SIZE,
    ApiError,
    KubeClient,
    KubeConfig,
    RetryPolicy,
    Unreachable,
    load_kubeconfig,
)
from tests.credentials import exec_calls, exec_user, kubeconfig


@dataclass
class Seen:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any


@dataclass
class Answer:
    status: int = 200
    body: Any = None
    headers: dict[str, str] | None = None


class ScriptedApi:
    """Answers requests from a queue; a token mismatch is a 401 like the real server's."""

    def __init__(self, token: str = "") -> None:
        self.token = token
        self.answers: list[Answer] = []
        self.seen: list[Seen] = []
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                return

            def _any(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                length = int(self.headers.get("Content-Length", "0"))
                raw = self.rfile.read(length) if length else b""
                api.seen.append(Seen(self.command, url.path,
                                     dict(urllib.parse.parse_qsl(url.query)),
                                     dict(self.headers), json.loads(raw) if raw else None))
                if api.token and self.headers.get("Authorization") != f"Bearer {api.token}":
                    answer = Answer(401, {"kind": "Status", "reason": "Unauthorized",
                                          "message": "bad token"})
                else:
                    answer = api.answers.pop(0) if api.answers else Answer(200, {})
                data = json.dumps(answer.body).encode()
                self.send_response(answer.status)
                for k, v in (answer.headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _any

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture()
def api() -> Iterator[ScriptedApi]:
    fake = ScriptedApi()
    yield fake
    fake.close()


def client(api: ScriptedApi, sleeps: list[float] | None = None, **kw: Any) -> KubeClient:
    return KubeClient(KubeConfig(server=api.url, token=api.token), timeout=5,
                      sleep=(sleeps if sleeps is not None else []).append, **kw)


def test_429_is_retried_after_the_servers_retry_after(api: ScriptedApi) -> None:
    api.answers = [Answer(429, {"reason": "TooManyRequests"}, {"Retry-After": "3"}),
                   Answer(201, {"metadata": {"name": "x"}})]
    sleeps: list[float] = []
    got = client(api, sleeps).create("/api/v1/namespaces/a/configmaps", {"metadata": {}})
    assert got["metadata"]["name"] == "x"
    assert sleeps == [3.0]
    assert [s.method for s in api.seen] == ["POST", "POST"]


def test_5xx_on_a_read_is_retried_with_backoff_until_the_budget_runs_out(
        api: ScriptedApi) -> None:
    api.answers = [Answer(503, {"reason": "ServiceUnavailable"})] * 3
    sleeps: list[float] = []
    kube = client(api, sleeps, retry=RetryPolicy(attempts=3, backoff_s=0.5))
    with pytest.raises(ApiError) as err:
        kube.get("/api/v1/nodes")
    assert err.value.status == 503
    assert sleeps == [0.5, 1.0]


def test_5xx_on_a_write_without_retry_after_is_not_repeated(api: ScriptedApi) -> None:
    api.answers = [Answer(500, {"reason": "InternalError", "message": "boom"})]
    sleeps: list[float] = []
    with pytest.raises(ApiError) as err:
        client(api, sleeps).create("/api/v1/namespaces/a/pods", {"metadata": {}})
    assert (err.value.status, err.value.reason) == (500, "InternalError")
    assert sleeps == [] and len(api.seen) == 1


def test_lists_follow_continue_tokens_page_by_page(api: ScriptedApi) -> None:
    api.answers = [
        Answer(200, {"metadata": {"continue": "p2"}, "items": [{"n": 1}, {"n": 2}]}),
        Answer(200, {"metadata": {"resourceVersion": "42"}, "items": [{"n": 3}]}),
    ]
    items, version = client(api).list_with_version("/api/v1/nodes", labelSelector="a=b")
    assert [i["n"] for i in items] == [1, 2, 3] and version == "42"
    assert [s.query.get("continue") for s in api.seen] == [None, "p2"]
    assert all(s.query["limit"] == str(LIST_PAGE_SIZE) and s.query["labelSelector"] == "a=b"
               for s in api.seen)


def test_an_expired_continue_token_starts_the_list_over_unpaged(api: ScriptedApi) -> None:
    api.answers = [
        Answer(200, {"metadata": {"continue": "p2"}, "items": [{"n": 1}]}),
        Answer(410, {"reason": "Expired"}),
        Answer(200, {"metadata": {"resourceVersion": "9"}, "items": [{"n": 1}, {"n": 2}]}),
    ]
    assert [i["n"] for i in client(api).list("/api/v1/pods")] == [1, 2]
    assert "limit" not in api.seen[-1].query


def test_server_side_apply_sends_the_field_manager_and_apply_content_type(
        api: ScriptedApi) -> None:
    client(api).apply("/api/v1/namespaces/a/configmaps/w", {"data": {"k": "v"}})
    seen = api.seen[0]
    assert seen.method == "PATCH" and seen.body == {"data": {"k": "v"}}
    assert seen.headers["Content-Type"] == "application/apply-patch+yaml"
    assert seen.query == {"fieldManager": "ringwright", "force": "true"}


def test_a_rotated_token_file_is_read_again_after_a_401(api: ScriptedApi,
                                                         tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("first")
    api.token = "first"
    kube = KubeClient(load_kubeconfig(kubeconfig(tmp_path / "kc", {"server": api.url},
                                                 {"tokenFile": str(token)})))
    kube.get("/api/v1/nodes")
    token.write_text("second")
    api.token = "second"  # the old token is revoked
    kube.get("/api/v1/nodes")
    assert [s.headers.get("Authorization") for s in api.seen] == [
        "Bearer first", "Bearer first", "Bearer second"]


def test_an_exec_plugin_kubeconfig_runs_the_plugin_and_again_after_a_401(
        api: ScriptedApi, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("from-plugin")
    api.token = "from-plugin"
    path = kubeconfig(tmp_path / "kc", {"server": api.url}, exec_user(tmp_path, token),
                      namespace="team")
    config = load_kubeconfig(path)
    assert (config.token, config.namespace) == ("from-plugin", "team")
    kube = KubeClient(config)
    kube.get("/api/v1/nodes")
    token.write_text("rotated")
    api.token = "rotated"
    kube.get("/api/v1/nodes")
    assert api.seen[-1].headers["Authorization"] == "Bearer rotated"
    assert exec_calls(token) == 2


def test_a_second_401_after_reloading_is_the_callers_error(api: ScriptedApi,
                                                           tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("wrong")
    api.token = "right"
    kube = KubeClient(load_kubeconfig(kubeconfig(tmp_path / "kc", {"server": api.url},
                                                 {"tokenFile": str(token)})))
    with pytest.raises(ApiError) as err:
        kube.get("/api/v1/nodes")
    assert err.value.status == 401 and len(api.seen) == 2


def test_an_unreachable_server_is_an_api_error_with_status_0() -> None:
    kube = KubeClient(KubeConfig(server="http://127.0.0.1:9"), timeout=2)
    with pytest.raises(Unreachable) as err:
        kube.get("/api/v1/nodes")
    assert err.value.status == 0
