"""The pod host's readiness probe decides like the kubelet: thresholds, period, defaults."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator

import pytest

from ringwright.devcluster.podhost import HttpProbe, ProbeRun
from ringwright.objects import Obj

PROBE = HttpProbe(path="/readyz", port=1, period_s=5.0, failure_threshold=2,
                  success_threshold=1)


def pod_with(probe: Obj | None) -> Obj:
    container: Obj = {"name": "main"}
    if probe is not None:
        container["readinessProbe"] = probe
    return {"spec": {"containers": [container]}}


def test_probe_read_from_the_pod_with_the_kubelets_defaults() -> None:
    got = HttpProbe.of(pod_with({"httpGet": {"path": "/readyz", "port": 29401},
                                 "periodSeconds": 5}))
    assert got == HttpProbe(path="/readyz", port=29401, period_s=5.0, timeout_s=1.0,
                            failure_threshold=3, success_threshold=1)


@pytest.mark.parametrize("probe", [None, {"exec": {"command": ["true"]}},
                                   {"httpGet": {"port": "readyz"}}])
def test_no_http_probe_with_a_numeric_port(probe: Obj | None) -> None:
    assert HttpProbe.of(pod_with(probe)) is None


@pytest.mark.parametrize(("results", "readiness"), [
    ([False], [True]),                         # one failure is not enough
    ([False, False], [True, False]),           # failureThreshold 2 in a row
    ([False, True, False], [True, True, True]),  # a success resets the count
    ([False, False, True], [True, False, True]),  # successThreshold 1
])
def test_readiness_follows_consecutive_results(results: list[bool],
                                               readiness: list[bool]) -> None:
    run = ProbeRun(ready=True)
    got = [run.record(PROBE, passed, now=5.0 * i) for i, passed in enumerate(results)]
    assert got == readiness


def test_probes_once_a_period() -> None:
    run = ProbeRun(ready=True)
    assert run.due(PROBE, 0.0)
    run.record(PROBE, True, 0.0)
    assert not run.due(PROBE, 4.9)
    assert run.due(PROBE, 5.0)


class _Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/readyz" else 503)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def server() -> Iterator[int]:
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Answer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def test_a_probe_is_an_http_get_that_must_answer_success(server: int) -> None:
    assert HttpProbe(path="/readyz", port=server).passes("127.0.0.1")
    assert not HttpProbe(path="/other", port=server).passes("127.0.0.1")
    # Nobody listening: a failure, not an error.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    assert not HttpProbe(path="/readyz", port=free).passes("127.0.0.1")
