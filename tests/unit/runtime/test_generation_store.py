"""The per-generation store and the torch.distributed backend, in one process on loopback."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from torch._C._distributed_c10d import PrefixStore, TCPStore

from ringwright.runtime.collectives.backend import (
    CollectiveError,
    RanksAbsent,
    RankTaken,
    Superseded,
)
from ringwright.runtime.collectives.torch_backend import TorchDistributedBackend
from ringwright.runtime.local.launcher import free_port
from ringwright.runtime.membership.generation_store import (
    StoreHost,
    await_published,
    claim_key,
    connect_client,
    generation_prefix,
    generation_store,
    join_barrier,
)
from ringwright.runtime.settings import RuntimeSettings
from ringwright.world import JobRef, Member, StoreAddress, World

ADDRESS = "127.0.0.77"
TOKEN = b"token-of-this-job"


def world(generation: int, size: int = 1, port: int = 0) -> World:
    members = tuple(Member(rank=i, pod=f"w-{i}", ip=ADDRESS) for i in range(size))
    return World(job=JobRef(namespace="ns", name="job"), generation=generation, members=members,
                 store=StoreAddress(address=ADDRESS, port=port or free_port()))


@pytest.fixture()
def host() -> Iterator[StoreHost]:
    h = StoreHost()
    yield h
    h.close()


def never() -> bool:
    return False


def test_the_store_listens_on_the_pod_address_only_and_is_kept_across_generations(
        host: StoreHost) -> None:
    port = free_port()
    first = host.serve(ADDRESS, port, 5)
    assert host.serve(ADDRESS, port, 5) is first
    # Another pod on the same machine can host its own store on the same port.
    other = StoreHost()
    try:
        other.serve("127.0.0.78", port, 5)
    finally:
        other.close()
    with pytest.raises(CollectiveError, match="cannot host the store"):
        StoreHost().serve(ADDRESS, port, 5)


def test_keys_of_different_generations_never_mix(host: StoreHost) -> None:
    raw = host.serve(ADDRESS, free_port(), 5)
    old = PrefixStore(generation_prefix(world(1)), raw)
    new = PrefixStore(generation_prefix(world(2)), raw)
    old.set("complete", "1")
    assert not new.check(["complete"])


def test_a_rank_can_be_claimed_once_per_generation(host: StoreHost) -> None:
    store = generation_store(host.serve(ADDRESS, free_port(), 5), world(1), TOKEN)
    join_barrier(store, 0, 1, deadline=time.monotonic() + 5, superseded=never)
    with pytest.raises(RankTaken):
        join_barrier(store, 0, 1, deadline=time.monotonic() + 5, superseded=never)


def test_only_claims_made_with_the_token_count(host: StoreHost) -> None:
    raw = host.serve(ADDRESS, free_port(), 5)
    ours = generation_store(raw, world(1), TOKEN)
    # An intruder that reaches the port writes junk where rank 1's claim goes, and one
    # with another job's token claims rank 1 in its own way.
    PrefixStore(generation_prefix(world(1)), raw).set(claim_key(ours, 1), "intruder")
    with pytest.raises(CollectiveError, match="only 1 of 2 members arrived"):
        join_barrier(generation_store(raw, world(1), b"token-of-another-job"), 1, 2,
                     deadline=time.monotonic() + 0.3, superseded=never)
    # Neither counts for this job's members, nor keeps rank 1 from its own member.
    with pytest.raises(CollectiveError, match="only 1 of 2 members arrived"):
        join_barrier(ours, 0, 2, deadline=time.monotonic() + 0.3, superseded=never)
    join_barrier(generation_store(raw, world(1), TOKEN), 1, 2, deadline=time.monotonic() + 5,
                 superseded=never)


def test_waiting_for_peers_stops_when_a_newer_world_appears(host: StoreHost) -> None:
    store = generation_store(host.serve(ADDRESS, free_port(), 5), world(1), TOKEN)
    polls: list[float] = []

    def superseded() -> bool:
        polls.append(time.monotonic())
        return len(polls) >= 2

    with pytest.raises(Superseded):
        join_barrier(store, 0, 2, deadline=time.monotonic() + 60, superseded=superseded)


def test_waiting_for_peers_has_a_deadline(host: StoreHost) -> None:
    store = generation_store(host.serve(ADDRESS, free_port(), 5), world(1), TOKEN)
    with pytest.raises(RanksAbsent, match="only 1 of 3 members arrived") as raised:
        join_barrier(store, 1, 3, deadline=time.monotonic() + 0.3, superseded=never)
    # Named, so that the world is not republished to wait for them again.
    assert raised.value.ranks == (0, 2)


def test_a_value_published_after_the_barrier_is_waited_for_until_it_comes(
        host: StoreHost) -> None:
    store = generation_store(host.serve(ADDRESS, free_port(), 5), world(1), TOKEN)
    polls = iter(range(100))

    def publish_on_the_third_poll() -> None:
        if next(polls) == 2:
            store.set("rendezvous", "127.0.0.77:1234")
        return None

    assert await_published(store, "rendezvous", superseded=never,
                           peers_dead=publish_on_the_third_poll) == b"127.0.0.77:1234"


def test_waiting_for_a_published_value_ends_with_a_newer_world_or_a_dead_peer(
        host: StoreHost) -> None:
    # The publisher passed the barrier and left for a newer world (or died): waiting
    # out the store's timeout would keep this member from that newer world.
    store = generation_store(host.serve(ADDRESS, free_port(), 60), world(1), TOKEN)
    calls = iter([False, True])
    with pytest.raises(Superseded):
        await_published(store, "rendezvous", superseded=lambda: next(calls),
                        peers_dead=lambda: None)
    verdicts = iter([None, "w-0 (rank 0): no heartbeat for 3.0s"])
    with pytest.raises(CollectiveError, match="no heartbeat"):
        await_published(store, "rendezvous", superseded=never,
                        peers_dead=lambda: next(verdicts))


def test_an_unreachable_store_host_gives_way_to_a_newer_world() -> None:
    calls = iter([False, True])
    with pytest.raises(Superseded):
        connect_client("127.0.0.79", free_port(), timeout_s=5, attempt_s=0.2,
                       deadline=time.monotonic() + 60, superseded=lambda: next(calls))
    with pytest.raises(RanksAbsent, match="unreachable") as raised:
        connect_client("127.0.0.79", free_port(), timeout_s=5, attempt_s=0.2,
                       deadline=time.monotonic(), superseded=never)
    assert raised.value.ranks == (0,)


def test_a_client_reaches_the_store_of_its_generation(host: StoreHost) -> None:
    port = free_port()
    server = host.serve(ADDRESS, port, 5)
    client = connect_client(ADDRESS, port, timeout_s=5, attempt_s=1,
                            deadline=time.monotonic() + 10, superseded=never)
    client.set("k", "v")
    assert server.get("k") == b"v"
    assert isinstance(client, TCPStore)


def test_the_torch_backend_rebuilds_its_group_for_each_generation() -> None:
    backend = TorchDistributedBackend(torch.device("cpu"), RuntimeSettings(collective_timeout_s=5))
    assert backend.name == "gloo"
    port = free_port()
    try:
        for generation in range(3):
            backend.init(world(generation, port=port), 0, never, print)
            assert backend.allreduce_max(generation) == generation
            sent = {"generation": generation}
            assert backend.broadcast_object(sent, 0) == sent
            assert backend.allgather_object(generation) == [generation]
            backend.barrier()
            backend.shutdown()
        backend.init(world(3, port=port), 0, never, print)
        model = torch.nn.Linear(3, 2)
        model.weight.grad = torch.ones_like(model.weight)
        backend.allreduce_gradients(model.parameters(), average=True)
        assert torch.equal(model.weight.grad, torch.ones_like(model.weight))
        assert model.bias.grad is not None and torch.equal(model.bias.grad, torch.zeros(2))
        before = [p.detach().clone() for p in model.parameters()]
        backend.broadcast_tensors(list(model.parameters()), 0)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    finally:
        backend.close()


def test_the_heartbeat_connection_is_opened_before_the_barrier(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every member opens it while it waits for its peers, not right after the barrier
    when all open one at once (see GenerationStores._beat_connection)."""
    from ringwright.runtime.membership import generation_store as module

    stores = module.GenerationStores(RuntimeSettings(join_token="t"))
    opened: list[str] = []
    real_connect = stores._connect

    def connect(w: World, timeout_s: float) -> object:
        opened.append("connection")
        return real_connect(w, timeout_s)

    def barrier(*args: object, **kwargs: object) -> None:
        opened.append("barrier")

    monkeypatch.setattr(stores, "_connect", connect)
    monkeypatch.setattr(module, "join_barrier", barrier)
    try:
        stores.meet(world(0), 0, never, on_failure=lambda f: None)
        time.sleep(1.5)  # a few beats: none opens another connection
        seen = list(opened)
    finally:
        stores.close()
    assert seen == ["connection", "barrier"]
