"""The Horovod backend's own logic: the env it hands Horovod, its rendezvous store, and
how it names collectives and reports failures (against a recording stand-in for
``horovod.torch``; real Horovod runs in tests/runtime/test_elastic_processes.py)."""

from __future__ import annotations

import http.client
import socket
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch._C._distributed_c10d import TCPStore

from ringwright.runtime.collectives.backend import CollectiveError, Superseded
from ringwright.runtime.collectives.horovod_backend import (
    RENDEZVOUS_KEY,
    HorovodBackend,
    horovod_env,
)
from ringwright.runtime.collectives.horovod_store import RendezvousStore
from ringwright.runtime.local.launcher import free_port
from ringwright.runtime.membership.generation_store import (
    StoreHost,
    claim_key,
    generation_store,
)
from ringwright.runtime.settings import RuntimeSettings
from ringwright.world import JobRef, Member, StoreAddress, World


def world(generation: int, ips: list[str]) -> World:
    members = tuple(Member(rank=i, pod=f"job-worker-{i}", ip=ip) for i, ip in enumerate(ips))
    return World(job=JobRef(namespace="ns", name="job"), generation=generation, members=members,
                 store=StoreAddress(address=ips[0], port=free_port()))


def test_env_names_the_pod_as_host_and_one_process_per_pod() -> None:
    w = world(3, ["10.1.0.5", "10.1.0.6", "10.1.0.7"])
    env = horovod_env(w, 2, "10.1.0.5", 41000, timeout_s=12.4)
    assert env == {
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.1.0.5", "HOROVOD_GLOO_RENDEZVOUS_PORT": "41000",
        "HOROVOD_GLOO_TIMEOUT_SECONDS": "12",
        "HOROVOD_RANK": "2", "HOROVOD_SIZE": "3",
        "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "1",
        "HOROVOD_CROSS_RANK": "2", "HOROVOD_CROSS_SIZE": "3",
        "HOROVOD_HOSTNAME": "job-worker-2",
    }
    # Pods on loopback addresses (local stand-ins) make gloo listen on lo.
    assert horovod_env(world(0, ["127.0.5.1"]), 0, "127.0.5.1", 1, 1)["HOROVOD_GLOO_IFACE"] == "lo"


@pytest.fixture()
def store() -> Iterator[RendezvousStore]:
    s = RendezvousStore("127.0.0.1")
    yield s
    s.close()


def request(store: RendezvousStore, method: str, path: str,
            body: bytes | None = None) -> tuple[int, bytes, str | None]:
    conn = http.client.HTTPConnection(store.address, store.port, timeout=5)
    try:
        conn.request(method, path, body=body)
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.getheader("Content-Length")
    finally:
        conn.close()


def test_store_speaks_horovods_protocol(store: RendezvousStore) -> None:
    assert request(store, "GET", "/global/rank_1") == (404, b"", "0"), "absent means not yet"
    assert request(store, "PUT", "/global/rank_1", b"\x00addr\xff")[0] == 200
    assert request(store, "GET", "/global/rank_1") == (200, b"\x00addr\xff", "6")
    assert request(store, "GET", "/local_job-worker-1/rank_1")[0] == 404, "scopes are separate"
    assert request(store, "DELETE", "/global/1")[0] == 200
    assert request(store, "PUT", "/no-key", b"x")[0] == 400
    assert store.keys() == ["/global/rank_1"]


def test_closing_the_store_does_not_wait_for_its_poll() -> None:
    """Rank 0 closes the last generation's store while the next generation's members wait for it
    at the join barrier: closing must not wait for the server's next poll."""
    s = RendezvousStore("127.0.0.1", poll_s=120.0)
    assert request(s, "PUT", "/global/rank_0", b"a")[0] == 200
    closing = threading.Thread(target=s.close, daemon=True)
    closing.start()
    closing.join(timeout=30.0)
    assert not closing.is_alive(), "close() waited for the server's 120 s poll"
    with pytest.raises(ConnectionRefusedError), socket.create_connection((s.address, s.port)):
        pass


class RecordingHorovod:
    """Stands in for ``horovod.torch``: one rank, records every call."""

    Sum, Average, Max = "sum", "average", "max"

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.env_at_init: dict[str, str] = {}
        self.environ: dict[str, str] = {}
        self.fail_next: str | None = None

    def _call(self, what: str, detail: Any = None) -> None:
        self.calls.append((what, detail))
        if self.fail_next == what:
            self.fail_next = None
            raise RuntimeError(f"Horovod has been shut down during {what}")

    def nccl_built(self) -> bool:
        return False

    def init(self) -> None:
        self.env_at_init = dict(self.environ)
        self._call("init")

    def shutdown(self) -> None:
        self._call("shutdown")

    def rank(self) -> int:
        return int(self.env_at_init["HOROVOD_RANK"])

    def size(self) -> int:
        return int(self.env_at_init["HOROVOD_SIZE"])

    def allreduce_(self, t: torch.Tensor, op: str, name: str) -> torch.Tensor:
        self._call("allreduce_", (op, name))
        return t

    def allreduce(self, t: torch.Tensor, op: str, name: str) -> torch.Tensor:
        self._call("allreduce", (op, name))
        return t.clone()

    def broadcast_(self, t: torch.Tensor, root_rank: int, name: str) -> torch.Tensor:
        self._call("broadcast_", (root_rank, name))
        return t

    def broadcast_object(self, obj: object, root_rank: int, name: str) -> object:
        self._call("broadcast_object", name)
        return obj

    def allgather_object(self, obj: object, name: str) -> list[object]:
        self._call("allgather_object", name)
        return [obj]

    def barrier(self) -> None:
        self._call("barrier")


def never() -> bool:
    return False


@pytest.fixture()
def fake() -> RecordingHorovod:
    return RecordingHorovod()


@pytest.fixture()
def backend(fake: RecordingHorovod) -> Iterator[HorovodBackend]:
    b = HorovodBackend(torch.device("cpu"), RuntimeSettings(collective_timeout_s=5),
                       hvd=fake, environ=fake.environ)
    yield b
    b.close()


def test_each_generation_inits_horovod_on_a_fresh_store_and_shuts_the_last_one_down(
        backend: HorovodBackend, fake: RecordingHorovod) -> None:
    backend.init(world(1, ["127.0.0.91"]), 0, never, print)
    first = fake.env_at_init
    assert first["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "127.0.0.91"
    assert (first["HOROVOD_RANK"], first["HOROVOD_SIZE"]) == ("0", "1")
    backend.init(world(2, ["127.0.0.91"]), 0, never, print)
    with pytest.raises(ConnectionError):
        # The previous generation's rendezvous store is gone.
        http.client.HTTPConnection("127.0.0.91", int(first["HOROVOD_GLOO_RENDEZVOUS_PORT"]),
                                   timeout=2).request("GET", "/global/rank_0")
    assert [c for c, _ in fake.calls] == ["init", "shutdown", "init"]
    assert fake.env_at_init["HOROVOD_GLOO_RENDEZVOUS_PORT"] != \
        first["HOROVOD_GLOO_RENDEZVOUS_PORT"]


def test_rank_zero_publishes_the_store_for_the_others(
        backend: HorovodBackend, fake: RecordingHorovod) -> None:
    w = world(1, ["127.0.0.92"])
    backend.init(w, 0, never, print)
    # Read it as another member would: a client of the generation store, with the job's token.
    client = TCPStore(w.store.address, w.store.port, None, False, timedelta(seconds=5),
                      wait_for_workers=False)
    published = generation_store(client, w, b"").get(RENDEZVOUS_KEY).decode()
    assert published == (f"127.0.0.92:{fake.env_at_init['HOROVOD_GLOO_RENDEZVOUS_PORT']}")


def test_a_member_past_the_barrier_follows_a_newer_world_when_rank_zero_left_for_it(
        backend: HorovodBackend, fake: RecordingHorovod) -> None:
    # Rank 0 claimed its rank, so the barrier passes here, but it saw the newer world
    # first and never publishes Horovod's store: this member must not wait for it.
    w = world(1, ["127.0.0.94", "127.0.0.95"])
    host = StoreHost()
    try:
        rank_zero = generation_store(host.serve(w.store.address, w.store.port, 60), w, b"")
        rank_zero.set(claim_key(rank_zero, 0), "rank zero")
        polls = iter([False, False, False, True])
        with pytest.raises(Superseded):
            backend.init(w, 1, lambda: next(polls), print)
    finally:
        host.close()
    assert fake.calls == []  # Horovod never started


def test_collectives_are_named_and_failures_become_collective_errors(
        backend: HorovodBackend, fake: RecordingHorovod) -> None:
    backend.init(world(1, ["127.0.0.93"]), 0, never, print)
    model = torch.nn.Linear(3, 2)
    model.weight.grad = torch.ones_like(model.weight)
    backend.allreduce_gradients(model.parameters(), average=True)
    assert model.bias.grad is not None and not model.bias.grad.any(), "missing grads are zeros"
    backend.broadcast_tensors([model.weight, model.bias], src=0)
    assert backend.allreduce_max(7) == 7
    assert backend.allgather_object("x") == ["x"]
    named = [d for c, d in fake.calls if c not in ("init", "barrier")]
    assert named == [("average", "ringwright.gradients.0"), (0, "ringwright.broadcast.0"),
                     ("max", "ringwright.max"), "ringwright.allgather_object"]

    fake.fail_next = "barrier"
    with pytest.raises(CollectiveError, match="barrier failed: Horovod has been shut down"):
        backend.barrier()
    backend.shutdown()
    assert fake.calls[-1] == ("shutdown", None)
