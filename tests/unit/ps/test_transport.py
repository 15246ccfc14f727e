"""The gRPC transport end to end on loopback: chunked dense pulls and staged pushes."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import zmq

from ringwright.runtime.ps.partition import Kind, TensorSpec
from ringwright.runtime.ps.process import held_elsewhere
from ringwright.runtime.ps.serving.consistency import Consistency, Mode
from ringwright.runtime.ps.serving.hosting import JobConfig, NotServing
from ringwright.runtime.ps.serving.optim import ServerOptimizer
from ringwright.runtime.ps.serving.replication import GrpcJournal, Replicator
from ringwright.runtime.ps.serving.server import ParameterServer
from ringwright.runtime.ps.serving.shard import initial_values
from ringwright.runtime.ps.wire import dataplane
from ringwright.runtime.ps.wire.client import PSClient, dense_chunks
from ringwright.runtime.ps.wire.codec import Header, Tensors, encode
from ringwright.runtime.ps.wire.transport import SERVICE, Stub, result, serve

SPECS = (TensorSpec("w", (300_000,)), TensorSpec("b", (7,)),
         TensorSpec("emb", (1000, 8), kind=Kind.EMBEDDING))


@pytest.fixture
def client() -> Iterator[PSClient]:
    # Port 0: each server takes a port the system knows is free (no pick-then-bind race).
    running = [serve(ParameterServer(i), "127.0.0.1:0") for i in range(2)]
    c = PSClient([f"127.0.0.1:{port}" for _, port in running], "w0", chunk_bytes=256 << 10)
    c.wait_ready(10)
    yield c
    c.close()
    for server, _ in running:
        server.stop(0)


def initialize(client: PSClient, seed: int) -> dict[str, torch.Tensor]:
    """Create the shards from random values (SGD at lr 0.5, async); those values."""
    torch.manual_seed(seed)
    params = {"w": torch.randn(300_000), "b": torch.randn(7), "emb": torch.randn(1000, 8)}
    config = JobConfig(SPECS, 2, ServerOptimizer(lr=0.5), Consistency(Mode.ASYNC, tau=5),
                       {"samples": 10, "pieceSize": 5, "epochs": 1})
    client.initialize(config, params)
    return params


def test_chunked_pull_and_staged_push_move_every_element(client: PSClient) -> None:
    params = initialize(client, 0)
    assert client.partition is not None
    assert max(len(dense_chunks(client.partition, s, 256 << 10)) for s in (0, 1)) > 1
    ids = torch.tensor([3, 999, 3, 500])
    pulled = client.pull({"emb": ids})
    assert torch.equal(pulled.dense["w"], params["w"])
    assert torch.equal(pulled.rows["emb"][1], params["emb"][[3, 500, 999]])
    grads = {"w": torch.ones(300_000), "b": torch.ones(7)}
    result = client.push(grads, {"emb": (torch.tensor([3, 500]), torch.ones(2, 8))},
                         pulled.versions)
    assert set(result.verdicts.values()) == {"apply"}
    after = client.pull({"emb": torch.tensor([3, 500, 999])})
    assert torch.allclose(after.dense["w"], params["w"] - 0.5)
    assert torch.allclose(after.dense["b"], params["b"] - 0.5)
    expected = params["emb"][[3, 500, 999]].clone()
    expected[:2] -= 0.5
    assert torch.allclose(after.rows["emb"][1], expected)


def test_a_pull_into_given_tensors_writes_them_in_place(client: PSClient) -> None:
    params = initialize(client, 1)
    model = {"w": torch.zeros(300_000)}  # "b" not given: pulled into a new tensor
    pulled = client.pull({}, into=model)
    assert pulled.dense["w"] is model["w"]
    assert torch.equal(model["w"], params["w"])
    assert torch.equal(pulled.dense["b"], params["b"])
    with pytest.raises(ValueError, match=r"cannot pull w into a torch\.float64 tensor"):
        client.pull({}, into={"w": torch.zeros(300_000, dtype=torch.float64)})
    with pytest.raises(ValueError, match="the servers hold 300000 float32 elements"):
        client.pull({}, into={"w": torch.zeros(10)})


def test_waiting_for_a_server_that_is_not_up_beats_the_watchdog() -> None:
    with socket.socket() as reserved:  # a port nobody listens on while the test runs
        reserved.bind(("127.0.0.1", 0))
        waiting = PSClient([f"127.0.0.1:{reserved.getsockname()[1]}"], "w0")
        beats: list[float] = []
        with pytest.raises(TimeoutError, match="not reachable within 3s"):
            waiting.wait_ready(3.0, lambda: beats.append(time.monotonic()))
        waiting.close()
    assert len(beats) >= 2


def test_the_data_journal_travels_over_grpc_and_a_stopped_replica_refuses_it() -> None:
    journal = GrpcJournal(timeout=2.0)
    primary, backup = ParameterServer(0, journal=journal), ParameterServer(1)
    for ps in (primary, backup):
        ps.set_workers(frozenset({"w0"}))
    running = [serve(ps, "127.0.0.1:0") for ps in (primary, backup)]
    addresses = [f"127.0.0.1:{port}" for _, port in running]
    c = PSClient(addresses, "w0", chunk_bytes=256 << 10)
    try:
        c.wait_ready(10)
        initialize(c, 0)
        Replicator(primary, 2).round(addresses)  # the copy of shard 0 turns the journal on
        lease = c.lease()
        taken = backup.promote(0)
        assert taken["version"] == 0 and backup.data is not None
        assert backup.data.holders() == {"w0"}  # the lease reached the replica
        running[1][0].stop(0).wait()
        assert not journal(addresses[1], [{"term": 0, "from": 1, "seq": 2,
                                           "op": ["release", "w0"]}])
        assert lease["status"] == "granted"
    finally:
        c.close()
        for server, _ in running:
            server.stop(0)


def test_a_shard_copy_travels_on_the_data_plane_not_over_grpc() -> None:
    primary, backup = ParameterServer(0), ParameterServer(1)
    for ps in (primary, backup):
        ps.set_workers(frozenset({"w0"}))
    running = [serve(ps, "127.0.0.1:0") for ps in (primary, backup)]
    addresses = [f"127.0.0.1:{port}" for _, port in running]
    c = PSClient(addresses, "w0", chunk_bytes=256 << 10)
    channel = grpc.insecure_channel(addresses[1])
    try:
        c.wait_ready(10)
        initialize(c, 0)
        Replicator(primary, 2).round(addresses)
        assert backup.status()["shards"]["0"]["role"] == "replica"
        # gRPC hands a message to Python as one bytes, copied many times on its way: a
        # whole shard is not sent that way, and the control plane does not take it.
        replicate: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
            f"/{SERVICE}/Replicate")
        with pytest.raises(grpc.RpcError) as refused:
            replicate(encode({"shard": 0, "version": 1}, {}), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        channel.close()
        c.close()
        for server, _ in running:
            server.stop(0)


def test_a_second_server_on_a_port_in_use_fails_to_start() -> None:
    # Shared, the port would hand the second server half of the first one's clients.
    first, port = serve(ParameterServer(0), "127.0.0.1:0")
    try:
        with pytest.raises(OSError, match="is another process on this port"):
            serve(ParameterServer(1), f"127.0.0.1:{port}")
    finally:
        first.stop(0)


def test_a_pull_that_needs_no_wait_is_answered_while_the_pool_is_busy() -> None:
    # One pool thread, taken by a pull waiting for a version the shard has not reached:
    # a pull of the version there is answered anyway, by the data plane's own loop.
    ps = ParameterServer(0)
    ps.set_workers(frozenset({"w0"}))
    waiting = threading.Event()
    pull = ps.pull

    def pull_that_shows_it_waits(header: Header, tensors: Tensors) -> tuple[Header, Tensors]:
        waiting.set()
        return pull(header, tensors)

    ps.pull = pull_that_shows_it_waits  # type: ignore[method-assign]
    server, port = serve(ps, "127.0.0.1:0", threads=1)
    address = f"127.0.0.1:{port}"
    c = PSClient([address], "w0")
    behind, ahead = Stub(address), Stub(address)
    try:
        c.wait_ready(10)
        config = JobConfig(SPECS, 1, ServerOptimizer(lr=0.5), Consistency(Mode.ASYNC, tau=5),
                           {"samples": 10, "pieceSize": 5, "epochs": 1})
        params = {"w": torch.randn(300_000), "b": torch.randn(7), "emb": torch.randn(1000, 8)}
        c.initialize(config, params)
        ids = {"i/emb": torch.tensor([4, 2])}
        later = behind.start("Pull", {"shard": 0, "minVersion": 1, "timeout": 120,
                                      "dense": False}, ids, timeout=120)
        assert waiting.wait(30)
        header, rows = ahead.call("Pull", {"shard": 0, "minVersion": 0, "dense": False}, ids,
                                  timeout=30)
        assert header["version"] == 0 and torch.equal(rows["emb"], params["emb"][[4, 2]])
        ps.step_down(0)  # ends the wait: the waiting pull is refused, and goes elsewhere
        with pytest.raises(grpc.RpcError) as refused:
            result(later)
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    finally:
        for closing in (c, behind, ahead):
            closing.close()
        server.stop(0)


FROZEN_SERVER = """
import sys, time
from ringwright.runtime.ps.serving.server import ParameterServer
from ringwright.runtime.ps.wire.transport import serve
_, port = serve(ParameterServer(0), "127.0.0.1:0")
print(port, flush=True)
time.sleep(600)
"""


def _states(pid: int) -> str:
    """The scheduler state of each thread of process ``pid`` (``T``: stopped)."""
    tasks = sorted(Path(f"/proc/{pid}/task").iterdir())
    return "".join((t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks)


def _freeze(server: subprocess.Popen[str]) -> None:
    """SIGSTOP ``server`` and wait until every one of its threads has stopped."""
    server.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while not set(_states(server.pid)) <= {"T", "t"}:
        assert time.monotonic() < deadline, f"threads not stopped: {_states(server.pid)}"
        time.sleep(0.01)


def test_a_call_to_a_frozen_server_fails_when_its_pings_go_unanswered() -> None:
    # A stopped process: its kernel still accepts and acknowledges TCP, nothing else.
    server = subprocess.Popen([sys.executable, "-c", FROZEN_SERVER], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert server.stdout is not None
        stub = Stub(f"127.0.0.1:{server.stdout.readline().strip()}")
        stub.call("Status", {}, timeout=30)
        _freeze(server)
        with pytest.raises(grpc.RpcError) as failed:
            stub.call("Status", {}, timeout=60)
        # Not the call's deadline: the transport gave up on the silent peer.
        assert failed.value.code() is grpc.StatusCode.UNAVAILABLE, _states(server.pid)
        stub.close()
    finally:
        server.kill()
        server.wait()


def test_a_data_call_to_a_frozen_server_fails_when_its_heartbeats_go_unanswered() -> None:
    server = subprocess.Popen([sys.executable, "-c", FROZEN_SERVER], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert server.stdout is not None
        stub = Stub(f"127.0.0.1:{server.stdout.readline().strip()}")
        # Connected: the server answers on its data plane (it serves no shard 5).
        with pytest.raises(grpc.RpcError) as refused:
            stub.call("Pull", {"shard": 5}, timeout=30)
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        _freeze(server)
        with pytest.raises(grpc.RpcError) as failed:
            stub.call("Pull", {"shard": 5}, timeout=60)
        # Not the call's deadline: the data plane gave up on the silent peer. (Should a
        # stopped server answer, the message says whether it still was stopped.)
        assert failed.value.code() is grpc.StatusCode.UNAVAILABLE, (
            f"server threads {_states(server.pid)}, data plane {stub.data._endpoint}")
        stub.close()
    finally:
        server.kill()
        server.wait()


def test_a_data_call_to_a_server_that_is_gone_fails_at_once() -> None:
    ps = ParameterServer(0)
    server, port = serve(ps, "127.0.0.1:0")
    stub = Stub(f"127.0.0.1:{port}")
    try:
        with pytest.raises(grpc.RpcError):
            stub.call("Pull", {"shard": 0}, timeout=30)  # connects; no shard 0 yet
        server.stop(0).wait()
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as failed:
            stub.call("Pull", {"shard": 0}, timeout=60)
        assert failed.value.code() is grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 30  # well before the call's deadline
    finally:
        stub.close()


def test_a_new_data_connection_is_used_as_soon_as_it_is_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Looking for the connection only every minute: what ends the wait for it must be
    # the handshake's own event (else the first call waits out the detection time).
    monkeypatch.setattr(dataplane, "_CONNECT_POLL_S", 60.0)
    monkeypatch.setattr(dataplane, "_WAIT_CAP_S", 60.0)
    read = dataplane._events
    seen: list[int] = []

    def events(monitor: Any) -> list[int]:
        seen.extend(got := read(monitor))
        return got

    monkeypatch.setattr(dataplane, "_events", events)
    ps = ParameterServer(0)
    server, port = serve(ps, "127.0.0.1:0")
    stub = Stub(f"127.0.0.1:{port}")
    try:
        with pytest.raises(grpc.RpcError) as refused:
            stub.call("Pull", {"shard": 0}, timeout=30)
        # Answered by the server (it holds no shard 0 yet).
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION, refused.value
        assert zmq.EVENT_HANDSHAKE_SUCCEEDED in seen, seen
    finally:
        stub.close()
        server.stop(0)


def test_a_refusal_says_where_a_handed_over_shard_went() -> None:
    def handed_over(header: Header, tensors: Tensors) -> tuple[Header, Tensors]:
        raise NotServing("ps 0 does not serve shard 2 (handed to ps 1)", moved_to=1)

    server = dataplane.DataServer({"Pull": handed_over}, "127.0.0.1:0")
    server.start()
    channel = dataplane.DataChannel("127.0.0.1:1", lambda timeout: server.port, 3.0)
    try:
        with pytest.raises(dataplane.DataCallError) as refused:
            channel.start("Pull", {"shard": 2}, {}, 30).result()
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert refused.value.moved_to == 1
    finally:
        channel.close()
        server.stop()


def test_a_server_asks_its_peers_before_it_restores_a_shard_from_a_checkpoint() -> None:
    holder = ParameterServer(1)
    config = JobConfig(SPECS, 2, ServerOptimizer(lr=0.5), Consistency(Mode.ASYNC, tau=5),
                       {"samples": 10, "pieceSize": 5, "epochs": 1})
    params = {"w": torch.zeros(300_000), "b": torch.zeros(7), "emb": torch.zeros(1000, 8)}
    holder.init({"shard": 1, "config": config.to_json()},
                initial_values(config.partition(), 1, params))
    server, port = serve(holder, "127.0.0.1:0")
    try:
        with socket.socket() as reserved:  # a peer that is down holds nothing
            reserved.bind(("127.0.0.1", 0))
            addresses = ["127.0.0.1:1", f"127.0.0.1:{port}",
                         f"127.0.0.1:{reserved.getsockname()[1]}"]
            assert held_elsewhere(1, addresses, 0, detect_s=3.0)  # a replacement: no restore
            assert not held_elsewhere(0, addresses, 0, detect_s=3.0)
    finally:
        server.stop(0)
