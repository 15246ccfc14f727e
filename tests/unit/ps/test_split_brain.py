"""No two primaries for one shard, and no push applied twice or half: the PS state
machine and its replicator, wired to each other without a transport."""

from __future__ import annotations

import threading

import pytest
import torch

from ringwright.runtime.ps.codec import Header, Tensors, decode
from ringwright.runtime.ps.consistency import Consistency, Mode
from ringwright.runtime.ps.hosting import IncompletePush, JobConfig, NotServing
from ringwright.runtime.ps.optim import ServerOptimizer
from ringwright.runtime.ps.partition import Kind, TensorSpec
from ringwright.runtime.ps.replication import Replicator
from ringwright.runtime.ps.server import ParameterServer
from ringwright.runtime.ps.shard import initial_values

SPECS = (TensorSpec("w", (4, 3)), TensorSpec("emb", (50, 2), kind=Kind.EMBEDDING))


def _pair(consistency: Consistency) -> tuple[list[ParameterServer], list[Replicator]]:
    """Two servers, each shard created on its home server, replicators wired directly."""
    config = JobConfig(SPECS, 2, ServerOptimizer(lr=0.1), consistency,
                       {"samples": 100, "pieceSize": 10, "epochs": 1})
    servers = [ParameterServer(0), ParameterServer(1)]
    params = {"w": torch.zeros(4, 3), "emb": torch.zeros(50, 2)}
    for i, ps in enumerate(servers):
        ps.init({"shard": i, "config": config.to_json()},
                initial_values(config.partition(), i, params))
        ps.set_workers(frozenset({"a", "b"}))

    def send(address: str, header: Header, tensors: Tensors) -> Header:
        return servers[int(address)].replicate(header, tensors)

    return servers, [Replicator(ps, 2, send) for ps in servers]


def _round(replicators: list[Replicator], *which: int) -> None:
    for i in which:
        replicators[i].round(["0", "1"])


def _push(ps: ParameterServer, worker: str, version: int, push: str = "",
          **extra: object) -> Header:
    part = ps.partition
    assert part is not None
    grads: Tensors = {f"g/w@{d.start}": torch.ones(d.stop - d.start) for d in part.dense_on(0)}
    return ps.push({"shard": 0, "worker": worker, "version": version, "push": push, **extra},
                   grads)


def _roles(ps: ParameterServer) -> dict[str, str]:
    return {s: info["role"] for s, info in ps.status()["shards"].items()}


def _w(ps: ParameterServer) -> torch.Tensor:
    _, values = decode(ps.pull({"shard": 0, "dense": True, "timeout": 0.0}, {}))
    return torch.cat([v.reshape(-1) for k, v in sorted(values.items())])


def test_home_primary_steps_down_when_its_replica_was_promoted_and_is_reseeded() -> None:
    (ps0, ps1), replicators = _pair(Consistency(Mode.ASYNC, tau=8))
    _push(ps0, "a", 0, "a.1")
    _round(replicators, 0)
    assert _roles(ps1) == {"0": "replica", "1": "primary"}
    # A worker that could not reach ps0 promoted the replica; ps0 still serves others.
    ps1.promote(0)
    _push(ps1, "b", 1, "b.1")
    _push(ps1, "b", 2, "b.2")
    _push(ps0, "a", 1, "a.2")  # ps0 and ps1 now disagree about shard 0
    # The promoted copy sending home is refused too, but keeps serving: the home steps down.
    _round(replicators, 1)
    assert _roles(ps1)["0"] == "primary"
    _round(replicators, 0)
    assert _roles(ps0) == {"0": "replica", "1": "replica"}
    with pytest.raises(NotServing):
        _push(ps0, "a", 2, "a.3")
    # The new primary re-seeds the home server with its own state.
    _round(replicators, 1)
    assert ps0.status()["shards"]["0"] == {"role": "replica", "version": 3}
    ps0.promote(0)
    assert torch.equal(_w(ps0), _w(ps1))
    assert torch.allclose(_w(ps1), torch.full_like(_w(ps1), -0.3))  # a.1, b.1, b.2


def test_a_pull_waiting_on_a_primary_that_steps_down_is_refused() -> None:
    (ps0, _), _ = _pair(Consistency(Mode.SYNC))
    failed: list[BaseException] = []

    def pull() -> None:
        try:
            ps0.pull({"shard": 0, "dense": True, "minVersion": 1, "timeout": 60.0}, {})
        except NotServing as exc:
            failed.append(exc)

    waiting = threading.Thread(target=pull)
    waiting.start()
    assert _push(ps0, "a", 0, "a.1")["verdict"] == "buffer"
    assert ps0.step_down(0) == {"version": 0, "roundDropped": 1}
    waiting.join(timeout=10)
    assert not waiting.is_alive() and len(failed) == 1


def test_a_retried_push_is_answered_again_not_applied_twice_even_after_failover() -> None:
    (ps0, ps1), replicators = _pair(Consistency(Mode.ASYNC, tau=8))
    first = _push(ps0, "a", 0, "a.1")
    assert _push(ps0, "a", 0, "a.1") == first  # the reply was lost; the worker retries
    assert first["version"] == 1
    _push(ps0, "b", 1, "b.1")
    _round(replicators, 0)
    ps1.promote(0)  # ps0 died after replicating b.1 and before b got its reply
    assert _push(ps1, "b", 1, "b.1")["version"] == 2
    assert _push(ps1, "b", 2, "b.2")["version"] == 3


def test_a_push_naming_staged_chunks_the_server_lacks_is_refused_not_half_applied() -> None:
    (ps0, _), _ = _pair(Consistency(Mode.ASYNC, tau=8))
    part = ps0.partition
    assert part is not None
    before = _w(ps0)
    with pytest.raises(IncompletePush):
        ps0.push({"shard": 0, "worker": "a", "version": 0, "push": "a.1", "staged": "a.1",
                  "stagedCount": 1}, {"i/emb": torch.tensor([], dtype=torch.int64),
                                      "r/emb": torch.zeros(0, 2)})
    assert torch.equal(_w(ps0), before)
    ps0.stage({"worker": "a", "staged": "a.2"},
              {f"g/w@{d.start}": torch.ones(d.stop - d.start) for d in part.dense_on(0)})
    reply = ps0.push({"shard": 0, "worker": "a", "version": 0, "push": "a.2",
                      "staged": "a.2", "stagedCount": len(part.dense_on(0))}, {})
    assert reply["verdict"] == "apply"
    assert torch.allclose(_w(ps0), before - 0.1)
