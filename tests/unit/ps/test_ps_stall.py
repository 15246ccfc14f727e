"""A parameter server whose handler threads are wedged fails its readiness; an idle one
does not. Real gRPC server and real ``/readyz`` endpoint on loopback (port 0)."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch

from ringwright.runtime.membership.file_source import FileMembershipSource, write_world_file
from ringwright.runtime.membership.health import ReadinessServer, StallWatchdog
from ringwright.runtime.ps.env import wait_until_listed
from ringwright.runtime.ps.partition import Kind, TensorSpec
from ringwright.runtime.ps.progress import ServingProgress
from ringwright.runtime.ps.serving.consistency import Consistency
from ringwright.runtime.ps.serving.consistency import Mode as ConsistencyMode
from ringwright.runtime.ps.serving.hosting import JobConfig
from ringwright.runtime.ps.serving.optim import ServerOptimizer
from ringwright.runtime.ps.serving.server import ParameterServer
from ringwright.runtime.ps.serving.shard import initial_values
from ringwright.runtime.ps.wire.codec import Header, Tensors
from ringwright.runtime.ps.wire.transport import Stub, result, serve
from ringwright.world import JobRef, Member, Mode, StoreAddress, World
from tests.waiting import wait_for

STALL_S = 0.6


class WedgedServer(ParameterServer):
    """Its pushes hang inside the handler until released (a deadlocked server)."""

    def __init__(self) -> None:
        super().__init__(0)
        self.release = threading.Event()

    def push(self, header: Header, tensors: Tensors) -> Header:
        self.release.wait(60)
        return {"verdict": "apply", "staleness": 0, "version": 0}


class Running:
    def __init__(self) -> None:
        self.ps = WedgedServer()
        self.watchdog = StallWatchdog(STALL_S)
        self.progress = ServingProgress(self.watchdog)
        self.server, port = serve(self.ps, "127.0.0.1:0", progress=self.progress)
        self.stub = Stub(f"127.0.0.1:{port}")
        self.readiness = ReadinessServer(self.watchdog, 0, "127.0.0.1")
        self.readiness.start()
        self.watchdog.start(0.05)
        # The PS main loop's ticks (process.run_server calls tick() every pass).
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(0.05):
            self.progress.tick()

    def ready(self) -> bool:
        url = f"http://127.0.0.1:{self.readiness.port}/readyz"
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                return bool(reply.status == 200)
        except urllib.error.HTTPError as err:
            assert err.code == 503
            return False

    def close(self) -> None:
        self.ps.release.set()
        self._stop.set()
        self.watchdog.stop()
        self.readiness.stop()
        self.stub.close()
        self.server.stop(0)


@pytest.fixture
def running() -> Iterator[Running]:
    r = Running()
    yield r
    r.close()


def _until(condition: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_an_idle_server_stays_ready(running: Running) -> None:
    time.sleep(3 * STALL_S)
    running.stub.call("Status", {}, timeout=5)
    assert running.ready()


def test_wedged_handlers_fail_readiness_and_recover_when_they_move(running: Running) -> None:
    pushed = running.stub.start("Push", {"shard": 0, "worker": "w"}, timeout=60)

    def stalled() -> bool:
        # Status still answers (it needs no shard lock): it must not count as progress.
        running.stub.call("Status", {}, timeout=5)
        return not running.ready()

    assert _until(stalled)
    running.ps.release.set()
    reply = pushed.result(timeout=30)
    assert reply
    assert _until(running.ready)


def test_a_call_that_fails_in_the_handler_still_counts_as_served(running: Running) -> None:
    with pytest.raises(grpc.RpcError):
        running.stub.call("Pull", {"shard": 5}, timeout=5)  # not served here
    time.sleep(3 * STALL_S)
    assert running.ready()


def test_pulls_waiting_on_a_wedged_update_are_not_progress(running: Running) -> None:
    spec = TensorSpec("emb", (100, 4), kind=Kind.EMBEDDING)
    config = JobConfig((spec,), 1, ServerOptimizer(lr=0.1), Consistency(ConsistencyMode.ASYNC, 4),
                       {"samples": 8, "pieceSize": 4, "epochs": 1})
    running.ps.init({"shard": 0, "config": config.to_json()},
                    initial_values(config.partition(), 0, {"emb": torch.zeros(100, 4)}))
    shard = running.ps.hosted[0].cond
    pulls = []
    with shard:  # an update that does not end holds the shard
        def stalled() -> bool:
            # Each pull is tried at once first and declined: the decline is no answer.
            pulls.append(running.stub.start("Pull", {"shard": 0, "dense": False},
                                            {"i/emb": torch.tensor([1, 2])}, timeout=60))
            return not running.ready()

        assert _until(stalled)
    assert all(result(p)[0]["version"] == 0 for p in pulls)
    assert _until(running.ready)


def _world(generation: int, ps: tuple[str, ...]) -> World:
    return World(job=JobRef(namespace="local", name="stall"), generation=generation,
                 mode=Mode.PARAMETER_SERVER, store=StoreAddress(address="127.0.0.1"),
                 members=(Member(rank=0, pod="w0", ip="127.0.0.1"),),
                 ps=tuple(Member(rank=i, pod=p, ip="127.0.0.1") for i, p in enumerate(ps)),
                 ps_replicas=2)


def test_a_pod_waiting_for_a_world_that_lists_it_keeps_beating(tmp_path: Path) -> None:
    path = tmp_path / "world.json"
    source = FileMembershipSource(path, poll_interval=0.02)
    beats: list[float] = []

    def publish() -> None:
        # Each world goes out once the waiter has beaten twice more: a waiter that stops
        # beating never sees the world that lists it, and the wait below times out.
        wait_for(lambda: len(beats) >= 2 or None, "beats before any world", timeout=20)
        write_world_file(path, _world(1, ("ps-0",)))  # not yet listing ps-1
        seen = len(beats)
        wait_for(lambda: len(beats) >= seen + 2 or None, "beats while not listed", timeout=20)
        write_world_file(path, _world(2, ("ps-0", "ps-1")))

    publisher = threading.Thread(target=publish)
    publisher.start()
    try:
        world = wait_until_listed(source, lambda w: any(m.pod == "ps-1" for m in w.ps),
                                  30.0, lambda: beats.append(time.monotonic()), poll_s=0.1)
    finally:
        publisher.join()
        source.close()
    assert world.generation == 2
