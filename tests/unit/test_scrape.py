"""The demo's metrics scrape: a process that misses one answer is asked again."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ringwright.devcluster.scrape import scrape

EXPOSITION = b"# TYPE ringwright_runtime_world_size gauge\nringwright_runtime_world_size 4.0\n"


class Busy(BaseHTTPRequestHandler):
    """Answers 503 to the first ``busy_for`` requests, then the exposition."""

    busy_for = 0
    seen = 0

    def do_GET(self) -> None:
        type(self).seen += 1
        if type(self).seen <= type(self).busy_for:
            self.send_response(503)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(EXPOSITION)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture()
def busy_server() -> Iterator[tuple[str, type[Busy]]]:
    handler = type("Handler", (Busy,), {"busy_for": 2, "seen": 0})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics", handler
    server.shutdown()
    server.server_close()


def test_a_patient_scrape_asks_again_until_the_process_answers(
    busy_server: tuple[str, type[Busy]],
) -> None:
    url, handler = busy_server
    got = scrape(url, patience=10.0)
    assert got is not None and got.get("ringwright_runtime_world_size") == 4.0
    assert handler.seen == 3


def test_an_impatient_scrape_reports_the_first_miss(busy_server: tuple[str, type[Busy]]) -> None:
    url, handler = busy_server
    assert scrape(url) is None
    assert handler.seen == 1
