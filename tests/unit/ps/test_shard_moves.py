"""A shard handed to its new home after a resize: the PS state machine, its replicator
and mover wired to each other without a transport, and the routing decision while a
shard moves."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

from ringwright.runtime.ps.partition import Kind, TensorSpec
from ringwright.runtime.ps.placement import Placement
from ringwright.runtime.ps.serving import server as server_module
from ringwright.runtime.ps.serving.consistency import Consistency, Mode
from ringwright.runtime.ps.serving.hosting import JobConfig, NotServing, Role
from ringwright.runtime.ps.serving.moving import Mover
from ringwright.runtime.ps.serving.optim import ServerOptimizer
from ringwright.runtime.ps.serving.replication import Replicator
from ringwright.runtime.ps.serving.server import MOVED_GRACE_S, HandOver, ParameterServer
from ringwright.runtime.ps.serving.shard import initial_values
from ringwright.runtime.ps.wire.codec import Header, Tensors
from ringwright.runtime.ps.wire.dataplane import DataCallError
from ringwright.runtime.ps.wire.routing import (
    Promote,
    Retry,
    Routes,
    ShardView,
    Wait,
    decide,
)

SPECS = (TensorSpec("w", (6, 40)), TensorSpec("emb", (50, 2), kind=Kind.EMBEDDING))
SHARDS = 3


def _job(mode: Mode = Mode.ASYNC) -> list[ParameterServer]:
    """Three shards on two servers (shards 0 and 2 on ps-0, 1 on ps-1) and a third
    server that holds nothing yet."""
    config = JobConfig(SPECS, SHARDS, ServerOptimizer(lr=0.1), Consistency(mode),
                       {"samples": 100, "pieceSize": 10, "epochs": 1})
    servers = [ParameterServer(i) for i in range(3)]
    params = {"w": torch.zeros(6, 40), "emb": torch.zeros(50, 2)}
    for shard, home in enumerate((0, 1, 0)):
        servers[home].init({"shard": shard, "config": config.to_json()},
                           initial_values(config.partition(), shard, params))
    for ps in servers:
        ps.set_workers(frozenset({"a", "b"}))
    return servers


def _push(ps: ParameterServer, shard: int, worker: str = "a", push: str = "",
          rows: int = 0) -> Header:
    """Push ones for the dense slices of ``shard`` and for its first ``rows`` rows."""
    part = ps.partition
    assert part is not None
    grads: Tensors = {f"g/w@{d.start}": torch.ones(d.stop - d.start)
                      for d in part.dense_on(shard)}
    if rows:
        ids = torch.from_numpy(part.rows_on("emb", shard)[:rows])
        grads.update({"i/emb": ids, "r/emb": torch.ones(len(ids), 2)})
    version = int(ps.status()["shards"][str(shard)]["version"])
    return ps.push({"shard": shard, "worker": worker, "version": version, "push": push}, grads)


def _role(ps: ParameterServer, shard: int) -> str | None:
    info = ps.status()["shards"].get(str(shard))
    return None if info is None else str(info["role"])


def _view(ps: ParameterServer) -> ShardView:
    """What a worker's probe reads from ``ps``."""
    return {int(s): (str(i["role"]), int(i["version"])) for s, i in ps.status()["shards"].items()}


def _adopt_on(ps: ParameterServer) -> HandOver:
    return lambda header, tensors: ps.adopt(header, tensors)["accepted"] is True


def test_a_hand_over_moves_the_primary_with_every_update() -> None:
    servers = _job()
    replies = [_push(servers[0], 2, push=f"p{i}") for i in range(3)]
    before = servers[0].checkpoint_payload(2)
    assert before is not None
    moved = servers[0].hand_over(2, _adopt_on(servers[2]))
    assert moved is not None and moved[0] == 3
    assert (_role(servers[0], 2), _role(servers[2], 2)) == ("moved", "primary")
    after = servers[2].checkpoint_payload(2)
    assert after is not None and after[0] == 3
    assert all(torch.equal(before[1][k], after[1][k]) for k in before[1])
    # The old home serves it no more; a push retried after a lost answer is known there.
    with pytest.raises(NotServing):
        _push(servers[0], 2)
    # (answered with its first reply, and not applied again).
    assert _push(servers[2], 2, push="p2") == replies[-1]
    assert _push(servers[2], 2, push="p3")["version"] == 4


def test_calls_during_a_hand_over_wait_and_then_follow_the_shard() -> None:
    servers = _job()
    outcome: list[object] = []
    started = threading.Event()

    def late_push() -> None:
        started.set()
        try:
            outcome.append(_push(servers[0], 2, push="late"))
        except NotServing as exc:
            outcome.append(exc)

    def send(header: Header, tensors: Tensors) -> bool:
        # The shard is on its way: a push that comes now must not be applied here.
        pusher = threading.Thread(target=late_push)
        pusher.start()
        started.wait()
        pusher.join(0.3)
        assert pusher.is_alive(), "a push was answered while the shard was moving"
        assert _role(servers[0], 2) == "moving"
        accepted = servers[2].adopt(header, tensors)["accepted"] is True
        threads.append(pusher)
        return accepted

    threads: list[threading.Thread] = []
    assert servers[0].hand_over(2, send, to=2) is not None
    threads[0].join(5)
    assert isinstance(outcome[0], NotServing), outcome
    assert outcome[0].moved_to == 2  # told where the shard went
    assert servers[2].status()["shards"]["2"]["version"] == 0  # nothing lost or half applied


def test_a_worker_told_where_a_shard_went_follows_it_without_asking_around() -> None:
    routes = Routes(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"])

    def asked(timeout: float) -> list[ShardView | None]:
        raise AssertionError("the servers were asked where the shard is")

    try:
        routes.place(SHARDS)
        routes.route[2] = 0  # shard 2 was at ps-0
        routes.views = asked  # type: ignore[method-assign]
        moved = DataCallError(grpc.StatusCode.FAILED_PRECONDITION, "handed to ps 2",
                              moved_to=2)
        routes.recover(2, moved, 0, None)
        assert routes.route[2] == 2
        # A hint back to the server that refused, or to one it does not know, is not
        # followed: the servers are asked.
        for bad in (2, 7):
            with pytest.raises(AssertionError, match="asked"):
                routes.recover(2, DataCallError(grpc.StatusCode.FAILED_PRECONDITION, "",
                                                moved_to=bad), 2, None)
    finally:
        routes.close()


def test_a_failed_hand_over_keeps_serving_at_the_old_home() -> None:
    servers = _job()
    assert servers[0].hand_over(2, lambda header, tensors: False) is None
    assert _role(servers[0], 2) == "primary"
    assert _push(servers[0], 2)["verdict"] == "apply"


def test_a_server_that_serves_the_shard_already_refuses_it() -> None:
    servers = _job()
    taken: list[tuple[Header, Tensors]] = []

    def undelivered(header: Header, tensors: Tensors) -> bool:
        taken.append((header, tensors))
        return False

    servers[0].hand_over(2, undelivered)
    assert servers[2].adopt(*taken[0])["accepted"] is True
    assert servers[2].adopt(*taken[0])["accepted"] is False


def test_the_data_shard_moves_with_its_queue() -> None:
    servers = _job()
    first = servers[0].lease({"worker": "a"})
    assert servers[0].hand_over(0, _adopt_on(servers[2])) is not None
    with pytest.raises(NotServing):
        servers[0].lease({"worker": "b"})
    # The same queue at the new home: the next piece, and the first one still leased.
    second = servers[2].lease({"worker": "b"})
    assert (second["piece"], second["epoch"]) != (first["piece"], first["epoch"])
    data = servers[2].status()["data"]
    assert data is not None and servers[0].status()["data"] is None


def test_a_sync_shard_moves_between_rounds_only() -> None:
    servers = _job(Mode.SYNC)
    _push(servers[0], 2, worker="a")  # buffered: b has not pushed this round
    assert servers[0].hand_over(2, _adopt_on(servers[2])) is None
    assert _role(servers[0], 2) == "primary"
    _push(servers[0], 2, worker="b")  # the round completes
    assert servers[0].hand_over(2, _adopt_on(servers[2])) is not None
    assert servers[2].status()["shards"]["2"]["version"] == 1


def test_the_mover_seeds_the_new_home_then_hands_over() -> None:
    servers = _job()
    addresses = ["0", "1", "2"]

    def replicate(address: str, header: Header, tensors: Tensors) -> Header:
        return servers[int(address)].replicate(header, tensors)

    def adopt(address: str, header: Header, tensors: Tensors) -> Header:
        return servers[int(address)].adopt(header, tensors)

    replicator = Replicator(servers[0], 2, replicate)
    mover = Mover(servers[0], adopt, address=addresses[0])
    mover.resized(2, 3)
    assert mover.pending == {2: 2}
    # Not before the new home holds a copy (it may still be starting).
    assert mover.round(addresses, Replicator(servers[0], 3, replicate)) == []
    assert _role(servers[0], 2) == "primary"
    replicator.round(addresses)  # a copy away from its (new) home goes home
    assert _role(servers[2], 2) == "replica"
    _push(servers[0], 2)  # an update after the seed travels with the hand-over
    [moved] = mover.round(addresses, replicator)
    assert (moved.shard, moved.to, moved.version) == (2, 2, 1)
    assert servers[2].status()["shards"]["2"] == {"role": "primary", "version": 1}
    assert mover.pending == {}
    # ps-0 is shard 2's replica host now: the new home's replication refreshes the copy
    # left there with what changed since the hand-over, not with the whole shard.
    assert _role(servers[0], 2) == "moved"
    _push(servers[2], 2, rows=3)
    sent: list[tuple[Header, Tensors]] = []

    def recorded(address: str, header: Header, tensors: Tensors) -> Header:
        sent.append((header, tensors))
        return replicate(address, header, tensors)

    Replicator(servers[2], 3, recorded).round(addresses)
    [(header, tensors)] = sent
    assert header["base"] == 1 and len(tensors["r/emb"]) == 3
    assert servers[0].status()["shards"]["2"] == {"role": "replica", "version": 2}
    servers[0].hosted[2].role = Role.PRIMARY  # to read the refreshed copy
    left, served = servers[0].checkpoint_payload(2), servers[2].checkpoint_payload(2)
    assert left is not None and served is not None
    assert all(torch.equal(left[1][k], served[1][k]) for k in served[1])


def _replicating(servers: list[ParameterServer], refuse: bool = False
                 ) -> tuple[Replicator, list[tuple[Header, Tensors]]]:
    """ps-0's replicator, delivering to ``servers`` and recording what it sent; with
    ``refuse``, the replica host refuses changes (as if it had lost its copy)."""
    sent: list[tuple[Header, Tensors]] = []

    def send(address: str, header: Header, tensors: Tensors) -> Header:
        sent.append((header, tensors))
        if refuse and "base" in header:
            return {"accepted": False, "whole": True, "version": -1}
        return servers[int(address)].replicate(header, tensors)

    return Replicator(servers[0], 2, send), sent


def test_replication_after_the_first_copy_sends_only_what_changed() -> None:
    servers = _job()
    replicator, sent = _replicating(servers)
    _push(servers[0], 2, rows=4)
    replicator.round(["0", "1"])  # shard 2's first copy to ps-1: the whole shard
    assert "base" not in sent[-1][0] and len(sent[-1][1]["t/emb"]) > 2
    _push(servers[0], 2, rows=2)
    replicator.round(["0", "1"])
    header, tensors = sent[-1]
    assert header["base"] == 1 and len(tensors["r/emb"]) == 2
    assert servers[1].status()["shards"]["2"] == {"role": "replica", "version": 2}
    servers[1].hosted[2].role = Role.PRIMARY  # to read the replica
    copy, primary = servers[1].checkpoint_payload(2), servers[0].checkpoint_payload(2)
    assert copy is not None and primary is not None
    assert all(torch.equal(copy[1][k], primary[1][k]) for k in primary[1])


def test_changes_a_replica_cannot_apply_are_followed_by_the_whole_shard() -> None:
    servers = _job()
    replicator, sent = _replicating(servers, refuse=True)
    replicator.round(["0", "1"])
    _push(servers[0], 2, rows=2)
    replicator.round(["0", "1"])  # changes only: refused, the copy there is unknown
    assert "base" in sent[-1][0] and 2 not in replicator.accepted
    replicator.round(["0", "1"])  # nothing changed since, but the whole shard goes
    assert "base" not in sent[-1][0]
    assert replicator.accepted[2] == ("1", 1)


def test_a_whole_copy_taken_while_the_shard_changes_is_exact_at_its_version(
        monkeypatch: pytest.MonkeyPatch) -> None:
    servers = _job()
    _push(servers[0], 2, rows=4)
    copied = server_module._copied
    calls: list[int] = []

    def copied_then_pushed(tensor: torch.Tensor, lock: threading.Condition) -> torch.Tensor:
        # The copy is taken a piece at a time, the lock let go between pieces: a push
        # lands after the first tensor was copied and before the others are.
        calls.append(1)
        if len(calls) == 2:
            _push(servers[0], 2, rows=2)
        return copied(tensor, lock)

    monkeypatch.setattr(server_module, "_copied", copied_then_pushed)
    snap = servers[0].snapshot(2, to="1")
    assert snap is not None and snap[0]["version"] == 2
    part, config = servers[0].partition, servers[0].config
    assert part is not None and config is not None
    state = server_module.with_fixes(part, 2, config, snap[1])
    held = servers[0].checkpoint_payload(2)
    assert held is not None and held[0] == 2
    assert all(torch.equal(state.payload()[k], held[1][k]) for k in held[1])


def test_a_hand_over_after_a_copy_sends_only_what_changed() -> None:
    servers = _job()

    def replicate(address: str, header: Header, tensors: Tensors) -> Header:
        return servers[int(address)].replicate(header, tensors)

    _push(servers[0], 2, rows=5)
    replicator = Replicator(servers[0], 3, replicate)
    replicator.round(["0", "1", "2"])  # the seed: shard 2 to its new home, version 1
    assert replicator.accepted[2] == ("2", 1)
    _push(servers[0], 2, rows=2)
    sent: list[Tensors] = []

    def adopt(header: Header, tensors: Tensors) -> bool:
        sent.append(tensors)
        return servers[2].adopt(header, tensors)["accepted"] is True

    assert servers[0].hand_over(2, adopt, base=1) is not None
    assert len(sent[0]["r/emb"]) == 2  # the rows the last push touched, not the table
    old, new = servers[0].checkpoint_payload, servers[2].checkpoint_payload
    servers[0].hosted[2].role = Role.PRIMARY  # to read the copy left behind
    left, adopted = old(2), new(2)
    assert left is not None and adopted is not None and left[0] == adopted[0] == 2
    assert all(torch.equal(left[1][k], adopted[1][k]) for k in left[1])


def test_a_hand_over_based_on_a_copy_the_new_home_lacks_is_refused() -> None:
    servers = _job()
    answers: list[Header] = []

    def adopt(header: Header, tensors: Tensors) -> bool:
        answers.append(servers[2].adopt(header, tensors))
        return answers[-1]["accepted"] is True

    servers[0].hosted[2].clean_since = 0  # as if a copy of version 0 had been taken
    assert servers[0].hand_over(2, adopt, base=0) is None  # ps-2 holds no copy at all
    assert answers[-1]["whole"] is True and _role(servers[0], 2) == "primary"
    assert servers[0].hand_over(2, adopt) is not None  # the whole shard


def test_the_copy_a_hand_over_leaves_is_not_promoted_at_once() -> None:
    # A new home busy taking a large shard may leave the workers' probe unanswered:
    # promoting the copy left behind would be a false failover.
    now = [0.0]
    servers = _job()
    servers[0].clock = lambda: now[0]
    assert servers[0].hand_over(2, _adopt_on(servers[2])) is not None
    with pytest.raises(NotServing):
        servers[0].promote(2)
    assert decide(2, 0, [_view(servers[0]), {}, None]) == Wait()
    # If the new home is gone for good, the copy is promoted after the grace period.
    now[0] = MOVED_GRACE_S
    assert servers[0].status()["shards"]["2"]["role"] == "replica"
    assert decide(2, 0, [_view(servers[0]), {}, None]) == Promote(0)
    assert servers[0].promote(2) == {"version": 0}


def test_replicas_that_no_longer_belong_here_are_dropped() -> None:
    servers = _job()

    def replicate(address: str, header: Header, tensors: Tensors) -> Header:
        return servers[int(address)].replicate(header, tensors)

    for home in (0, 1):
        Replicator(servers[home], 2, replicate).round(["0", "1"])
    assert (_role(servers[0], 1), _role(servers[1], 0), _role(servers[1], 2)) == (
        "replica", "replica", "replica")
    # With three servers shard 1's replica lives on ps-2 and shard 2's on ps-0: a stale
    # copy left behind could be promoted after a failure.
    three = Placement(SHARDS, 3)
    assert servers[0].drop_replicas(lambda s: three.keeps(s, 0)) == [1]
    assert servers[1].drop_replicas(lambda s: three.keeps(s, 1)) == [2]
    assert _role(servers[1], 0) == "replica"


def test_a_shard_being_moved_is_waited_for_never_promoted() -> None:
    moving = {2: ("moving", 5)}
    assert decide(2, 0, [moving, {}, {2: ("replica", 4)}]) == Wait()
    # Once its new home serves it, calls go there; if the moving server died meanwhile,
    # the replica is promoted as after any failure.
    assert decide(2, 0, [{2: ("replica", 5)}, {}, {2: ("primary", 5)}]) == Retry(2)
    assert decide(2, 0, [None, {}, {2: ("replica", 4)}]) == Promote(2)


def test_routes_follow_servers_that_join_and_keep_those_that_leave() -> None:
    routes = Routes(["127.0.0.1:1", "127.0.0.1:2"])
    try:
        routes.place(SHARDS)
        assert routes.route == [0, 1, 0]
        routes.set_addresses(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"])
        assert routes.servers == 3 and routes.placement.servers == 3
        routes.set_addresses(["127.0.0.1:1", "127.0.0.1:2"])
        # ps-2 may still serve shard 2 until it has handed it over.
        assert routes.servers == 3 and routes.placement.servers == 2
    finally:
        routes.close()


def test_replication_waits_its_interval_unless_the_servers_changed() -> None:
    servers = _job()
    now = [0.0]
    sent: list[Header] = []

    def send(address: str, header: Header, tensors: Tensors) -> Header:
        sent.append(header)
        return servers[int(address)].replicate(header, tensors)

    replicator = Replicator(servers[0], 2, send, every_s=1.0, clock=lambda: now[0])
    replicator.round(["0", "1"])  # shards 0 and 2, whole, to ps-1
    seeded = len(sent)
    _push(servers[0], 2, rows=2)
    now[0] = 0.5
    replicator.round(["0", "1"])
    assert len(sent) == seeded  # not due for another half second
    now[0] = 1.0
    replicator.round(["0", "1"])
    assert len(sent) == seeded + 1 and sent[-1]["base"] == 0
    _push(servers[0], 2, rows=1)
    now[0] = 1.2
    replicator.round(["0", "1", "2"])  # a third server: its shard is seeded at once
    assert len(sent) > seeded + 1
