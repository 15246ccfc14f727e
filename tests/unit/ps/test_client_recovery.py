"""A worker's client through real PS faults: real gRPC servers on loopback (port 0),
stopped and restarted at awkward moments. The worker carries on, promotes a replica
only when the primary is really gone, and loses no gradient it pushed."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch

from ringwright.runtime.ps.partition import Kind, TensorSpec
from ringwright.runtime.ps.serving.consistency import Consistency, Mode
from ringwright.runtime.ps.serving.hosting import JobConfig
from ringwright.runtime.ps.serving.optim import ServerOptimizer
from ringwright.runtime.ps.serving.replication import Replicator
from ringwright.runtime.ps.serving.server import ParameterServer
from ringwright.runtime.ps.wire.client import PSClient
from ringwright.runtime.ps.wire.codec import Header, Tensors
from ringwright.runtime.ps.wire.routing import RecoverySettings, ShardUnavailable
from ringwright.runtime.ps.wire.transport import serve

SPECS = (TensorSpec("w", (300_000,)), TensorSpec("b", (7,)),
         TensorSpec("emb", (1000, 8), kind=Kind.EMBEDDING))
CHUNK = 256 << 10
"""Small chunks: every push of ``w`` is staged."""


class GatedServer(ParameterServer):
    """A PS whose pushes can be held inside the handler (to stop the server mid-push)."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.hold = threading.Event()
        self.holding = threading.Event()
        self.release = threading.Event()

    def push(self, header: Header, tensors: Tensors) -> Header:
        if self.hold.is_set():
            self.holding.set()
            self.release.wait(30)
        return super().push(header, tensors)


def _reserve() -> socket.socket:
    """A socket that holds a free port on loopback, never listening (a connection there
    is refused while its server is stopped). With SO_REUSEADDR on both, a server may
    bind and listen on the port beside it (gRPC's servers set it), and the kernel hands
    it to no ``bind(0)`` or ``connect``."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class Servers:
    """Two parameter servers on loopback that the test stops and starts."""

    def __init__(self) -> None:
        self.ps = [GatedServer(0), GatedServer(1)]
        # Each port stays this fixture's while its server is stopped: the system would
        # hand a freed port to any other socket on the machine (in a full run one took
        # it within the 1.5 s a server was down, and the restart failed to bind). A PS
        # pod's port is its own, in its own network namespace.
        self.reserved = [_reserve() for _ in self.ps]
        self.ports: list[int] = [sock.getsockname()[1] for sock in self.reserved]
        self.running: list[grpc.Server | None] = [
            serve(ps, f"127.0.0.1:{port}")[0] for ps, port in zip(self.ps, self.ports, strict=True)]
        self.addresses = [f"127.0.0.1:{p}" for p in self.ports]
        self.start_failed: list[Exception] = []
        self.timers: list[threading.Timer] = []
        self.replicators = [Replicator(ps, 2) for ps in self.ps]

    def stop(self, i: int) -> None:
        server = self.running[i]
        assert server is not None
        server.stop(0).wait()
        self.running[i] = None

    def start(self, i: int) -> None:
        """Serve the same state on the same port again (a network blip, not a restart)."""
        self.running[i] = serve(self.ps[i], self.addresses[i])[0]

    def start_later(self, i: int, delay: float) -> threading.Timer:
        """:meth:`start` server ``i`` after ``delay`` s on a timer (started); how that
        failed, if it did, is kept for the fixture to raise: the client only sees a
        server that stays unreachable."""

        def start() -> None:
            try:
                self.start(i)
            except Exception as exc:
                self.start_failed.append(exc)

        timer = threading.Timer(delay, start)
        timer.start()
        self.timers.append(timer)
        return timer

    def replicate(self) -> None:
        for i, replicator in enumerate(self.replicators):
            if self.running[i] is not None:
                replicator.round(self.addresses)

    def roles(self, i: int) -> dict[str, str]:
        return {s: v["role"] for s, v in self.ps[i].status()["shards"].items()}

    def close(self) -> None:
        # A timer left to fire would serve on a port no longer reserved, beside whatever
        # server took it since, for as long as the test process lives.
        for timer in self.timers:
            timer.cancel()
            timer.join()
        for ps in self.ps:
            ps.release.set()
        for server in self.running:
            if server is not None:
                server.stop(0)
        for sock in self.reserved:
            sock.close()


class StagingClient(PSClient):
    """Runs ``after_stage`` once, between a push's Stage calls and its Push."""

    after_stage: Callable[[], None] | None = None

    def _stage(self, requests: dict[int, tuple[Header, Tensors]], push_id: str
               ) -> dict[int, tuple[int, Tensors]]:
        staged = super()._stage(requests, push_id)
        hook, self.after_stage = self.after_stage, None
        if hook is not None:
            hook()
        return staged


@pytest.fixture
def servers() -> Iterator[Servers]:
    s = Servers()
    yield s
    s.close()
    if s.start_failed:
        raise RuntimeError("a stopped server could not serve again") from s.start_failed[0]


PARAMS = {"w": torch.randn(300_000, generator=torch.Generator().manual_seed(0)),
          "b": torch.zeros(7), "emb": torch.zeros(1000, 8)}


def _client(servers: Servers, consistency: Consistency, worker: str = "w0", *,
            call_timeout: float = 60.0, deadline_s: float = 30.0) -> StagingClient:
    client = StagingClient(servers.addresses, worker, chunk_bytes=CHUNK,
                           call_timeout=call_timeout,
                           recovery=RecoverySettings(deadline_s=deadline_s))
    client.wait_ready(10)
    config = JobConfig(SPECS, 2, ServerOptimizer(lr=0.5), consistency,
                       {"samples": 64, "pieceSize": 8, "epochs": 1})
    client.initialize(config, PARAMS)
    servers.replicate()
    assert servers.roles(1) == {"0": "replica", "1": "primary"}
    return client


GRADS = {"w": torch.ones(300_000), "b": torch.ones(7)}
ASYNC = Consistency(Mode.ASYNC, tau=8)


def _push(client: PSClient) -> set[str]:
    result = client.push(GRADS, {}, client.versions_map())
    return set(result.verdicts.values())


def test_a_push_staged_on_a_primary_that_dies_before_its_push_is_not_lost(
        servers: Servers) -> None:
    client = _client(servers, ASYNC)
    client.after_stage = lambda: servers.stop(0)
    assert _push(client) == {"apply"}
    assert [shard for shard, _ in client.failovers] == [0]
    # Every element moved once, the ones of shard 0 on its promoted replica.
    assert torch.allclose(client.pull({}).dense["w"], PARAMS["w"] - 0.5)
    client.close()


def test_a_primary_stopped_while_it_handles_a_push_fails_over_and_the_push_lands_once(
        servers: Servers) -> None:
    client = _client(servers, ASYNC)
    servers.ps[0].hold.set()

    def stop_mid_push() -> None:
        servers.ps[0].holding.wait(30)
        servers.stop(0)

    stopper = threading.Thread(target=stop_mid_push)
    stopper.start()
    assert _push(client) == {"apply"}
    stopper.join()
    assert servers.roles(1) == {"0": "primary", "1": "primary"}
    assert torch.allclose(client.pull({}).dense["w"], PARAMS["w"] - 0.5)
    client.close()


def test_a_slow_sync_pull_is_waited_for_not_failed_over(servers: Servers) -> None:
    sync = Consistency(Mode.SYNC)
    for ps in servers.ps:
        ps.set_workers(frozenset({"w0", "w1"}))
    # Calls time out long before the round completes: the primary is slow, not gone.
    client = _client(servers, sync, call_timeout=0.5)
    other = _client(servers, sync, "w1")
    versions = client.versions_map()
    assert _push(client) == {"buffer"}
    late = threading.Timer(2.0, lambda: other.push(GRADS, {}, versions))
    late.start()
    pulled = client.pull({}, min_versions={0: 1, 1: 1})
    late.join()
    assert pulled.versions == {0: 1, 1: 1}
    assert client.failovers == []
    assert servers.roles(0) == {"0": "primary", "1": "replica"}
    assert servers.roles(1) == {"0": "replica", "1": "primary"}
    client.close()
    other.close()


def test_a_sync_round_slower_than_the_servers_wait_is_waited_for_again(
        servers: Servers) -> None:
    sync = Consistency(Mode.SYNC)
    for ps in servers.ps:
        ps.set_workers(frozenset({"w0", "w1"}))
    beats: list[float] = []
    client = _client(servers, sync)
    client.beat = lambda: beats.append(time.monotonic())
    other = _client(servers, sync, "w1")
    versions = client.versions_map()
    assert _push(client) == {"buffer"}
    late = threading.Timer(2.0, lambda: other.push(GRADS, {}, versions))
    late.start()
    # Each server waits 0.3 s for the round, well before the peer pushes: an answer
    # at the old version is not what was asked for (parameters the round has not
    # updated yet), and the wait is no stall of this worker.
    pulled = client.pull({}, min_versions={0: 1, 1: 1}, timeout=0.3)
    late.join()
    assert pulled.versions == {0: 1, 1: 1}
    assert torch.allclose(pulled.dense["w"], PARAMS["w"] - 0.5)
    assert len(beats) >= 3
    assert client.failovers == []
    client.close()
    other.close()


def test_a_shard_behind_what_this_worker_saw_is_taken_as_it_is(servers: Servers) -> None:
    # As after a restore from a checkpoint older than the round this worker waits for:
    # nobody would push the shard up to that version while this worker waits.
    client = _client(servers, Consistency(Mode.SYNC))
    client.versions = [5, 5]
    pulled = client.pull({}, min_versions={0: 6, 1: 6}, timeout=0.3)
    assert pulled.versions == {0: 0, 1: 0}
    client.close()


def test_a_backup_briefly_unreachable_right_after_a_failover_is_waited_for(
        servers: Servers) -> None:
    client = _client(servers, ASYNC)
    servers.stop(0)
    assert _push(client) == {"apply"}  # fails over shard 0 to ps 1
    servers.stop(1)
    restart = servers.start_later(1, 1.5)
    assert _push(client) == {"apply"}  # route already at the backup, and it is down
    restart.join()
    assert torch.allclose(client.pull({}).dense["w"], PARAMS["w"] - 1.0)
    client.close()


def test_no_server_left_fails_with_the_shard_the_servers_and_what_to_do(
        servers: Servers) -> None:
    client = _client(servers, ASYNC, deadline_s=1.0)
    servers.stop(0)
    servers.stop(1)
    with pytest.raises(ShardUnavailable) as failed:
        _push(client)
    message = str(failed.value)
    assert "shard 0" in message or "shard 1" in message
    assert all(address in message for address in servers.addresses)
    assert "RINGWRIGHT_PS_RECOVER_SECONDS" in message
    client.close()

