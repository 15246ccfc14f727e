"""A real node's kubelet starts only once containerd's CRI service answers, not when its
socket first accepts connections (containerd answers "server is not initialized yet"
for a while after that; a kubelet started then exits)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from ringwright.devcluster.node.host import CRI_VERSION, HostError, Proc, wait_for_cri
from ringwright.procstat import start_ticks


class StartingCri(grpc.GenericRpcHandler):
    """The CRI's Version call as containerd answers it: "not initialized" ``refusals``
    times, then an (empty) version."""

    def __init__(self, refusals: int) -> None:
        self.refusals, self.calls = refusals, 0

    def service(self, details: grpc.HandlerCallDetails
                ) -> grpc.RpcMethodHandler[bytes, bytes] | None:
        if details.method != CRI_VERSION:
            return None
        return grpc.unary_unary_rpc_method_handler(self._version)

    def _version(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self.calls += 1
        if self.calls <= self.refusals:
            context.abort(grpc.StatusCode.UNKNOWN, "server is not initialized yet")
        return b""


@pytest.fixture()
def serve(tmp_path: Path) -> Iterator[tuple[Path, StartingCri]]:
    socket = tmp_path / "containerd.sock"
    cri = StartingCri(refusals=3)
    server = grpc.server(ThreadPoolExecutor(2), handlers=[cri])
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    yield socket, cri
    server.stop(None)


def this_process() -> Proc:
    ticks = start_ticks(os.getpid())
    assert ticks is not None
    return Proc("containerd", "node-0", os.getpid(), ticks)


def test_the_wait_ends_once_the_cri_answers_not_when_the_socket_opens(
        serve: tuple[Path, StartingCri], tmp_path: Path) -> None:
    socket, cri = serve
    wait_for_cri(socket, this_process(), tmp_path / "containerd.log", timeout=30)
    assert cri.calls == 4  # three refusals, then the answer


def test_a_cri_that_never_answers_is_an_error_naming_its_last_answer(
        tmp_path: Path, serve: tuple[Path, StartingCri]) -> None:
    socket, cri = serve
    cri.refusals = 10**6
    with pytest.raises(HostError, match="not initialized yet"):
        wait_for_cri(socket, this_process(), tmp_path / "containerd.log", timeout=1.5)
