"""No two primaries for one shard, no push applied twice or half, and no sample trained
twice or lost when the data-shard service fails over: the PS state machine, its
replicator and its data journal, wired to each other without a transport."""

from __future__ import annotations

import threading

import pytest
import torch

from ringwright.runtime.ps.partition import Kind, TensorSpec
from ringwright.runtime.ps.serving.consistency import Consistency, Mode
from ringwright.runtime.ps.serving.hosting import IncompletePush, JobConfig, NotServing
from ringwright.runtime.ps.serving.optim import ServerOptimizer
from ringwright.runtime.ps.serving.replication import Replicator
from ringwright.runtime.ps.serving.server import ParameterServer
from ringwright.runtime.ps.serving.shard import initial_values
from ringwright.runtime.ps.wire.codec import Header, Tensors

SPECS = (TensorSpec("w", (4, 3)), TensorSpec("emb", (50, 2), kind=Kind.EMBEDDING))


def _pair(consistency: Consistency, unreachable: set[str] | None = None,
          journaled: list[Header] | None = None
          ) -> tuple[list[ParameterServer], list[Replicator]]:
    """Two servers, each shard created on its home server, replicators and data journal
    wired directly; a journal entry for an ``unreachable`` address is not delivered,
    every one sent is added to ``journaled``."""
    config = JobConfig(SPECS, 2, ServerOptimizer(lr=0.1), consistency,
                       {"samples": 100, "pieceSize": 10, "epochs": 1})

    def journal(address: str, entries: list[Header]) -> bool:
        if journaled is not None:
            journaled.extend(entries)
        if unreachable is not None and address in unreachable:
            return False
        return servers[int(address)].journal({"entries": entries})["accepted"] is True

    servers = [ParameterServer(0, journal=journal), ParameterServer(1, journal=journal)]
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


def _report(ps: ParameterServer, worker: str, lease: Header, start: int, stop: int,
            push: str) -> Header:
    version = int(ps.status()["shards"]["0"]["version"])
    return _push(ps, worker, version, push,
                 data={"piece": lease["piece"], "start": start, "stop": stop})


def _trained(ps: ParameterServer) -> dict[str, int]:
    data = ps.status()["data"]
    assert data is not None
    trained: dict[str, int] = data["trained"]
    return trained


def _roles(ps: ParameterServer) -> dict[str, str]:
    return {s: info["role"] for s, info in ps.status()["shards"].items()}


def _w(ps: ParameterServer) -> torch.Tensor:
    _, values = ps.pull({"shard": 0, "dense": True, "timeout": 0.0}, {})
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


def test_a_failover_of_the_data_service_keeps_every_sample_reported_before_it() -> None:
    (ps0, ps1), replicators = _pair(Consistency(Mode.ASYNC, tau=8))
    _round(replicators, 0)  # shard 0 and the data service copied: the journal is armed
    a = ps0.lease({"worker": "a"})
    b = ps0.lease({"worker": "b"})
    start = int(a["start"])
    assert _report(ps0, "a", a, start, start + 4, "a.1")["dataAccepted"]
    assert _report(ps0, "a", a, start + 4, start + 8, "a.2")["dataAccepted"]
    assert _report(ps0, "b", b, int(b["start"]), int(b["stop"]), "b.1")["dataAccepted"]
    # ps0 dies before its next replication round; the replica takes over.
    ps1.promote(0)
    assert _trained(ps1) == {"0": 18}
    # "a" goes on from where it was; "b" gets a piece nobody trained.
    assert _report(ps1, "a", a, start + 8, int(a["stop"]), "a.3")["dataAccepted"]
    following = ps1.lease({"worker": "b"})
    assert following["piece"] not in (a["piece"], b["piece"])
    assert _trained(ps1) == {"0": 20}


def test_a_report_retried_after_the_failover_that_lost_its_answer_counts_once() -> None:
    (ps0, ps1), replicators = _pair(Consistency(Mode.ASYNC, tau=8))
    _round(replicators, 0)
    a = ps0.lease({"worker": "a"})
    start = int(a["start"])
    _report(ps0, "a", a, start, start + 5, "a.1")  # journaled; the answer never came
    ps1.promote(0)
    again = ps1.push({"shard": 0, "worker": "a", "version": 0, "push": "a.1",
                      "data": {"piece": a["piece"], "start": start, "stop": start + 5}}, {})
    assert again["dataAccepted"] and _trained(ps1) == {"0": 5}
    # A lease asked again (its answer lost too) is the piece held, from its next sample.
    held = ps1.lease({"worker": "a"})
    assert (held["piece"], held["start"]) == (a["piece"], start + 5)


def test_changes_made_while_a_copy_is_on_its_way_follow_it_once_it_is_accepted() -> None:
    journaled: list[Header] = []
    (ps0, ps1), _ = _pair(Consistency(Mode.ASYNC, tau=8), journaled=journaled)
    copy = ps0.snapshot(0, to="1")  # taken; delivered only after the changes below
    assert copy is not None
    a = ps0.lease({"worker": "a"})
    _report(ps0, "a", a, int(a["start"]), int(a["stop"]), "a.1")
    ps0.lease({"worker": "a"})
    assert journaled == []  # the replica could not replay them yet
    ps1.replicate(*copy)
    ps0.copied(0, "1")
    assert len(journaled) == 3
    ps1.promote(0)
    assert ps0.data is not None and ps1.data is not None
    assert ps1.data.term == ps0.data.term + 1
    primary, promoted = ps0.data.to_json(), ps1.data.to_json()
    assert {**promoted, "term": 0, "seq": 0} == {**primary, "term": 0, "seq": 0}


def test_a_journal_that_cannot_be_delivered_is_replaced_by_a_whole_copy() -> None:
    unreachable: set[str] = set()
    journaled: list[Header] = []
    (ps0, ps1), replicators = _pair(Consistency(Mode.ASYNC, tau=8), unreachable, journaled)
    _round(replicators, 0)
    assert ps0.snapshot(0, to="1") is None  # nothing changed since the copy
    unreachable.add("1")
    a = ps0.lease({"worker": "a"})
    b = ps0.lease({"worker": "b"})
    assert len(journaled) == 1  # not sent again until a whole copy re-arms it
    unreachable.clear()
    # The copy is due although no parameter changed; it carries both leases.
    _round(replicators, 0)
    _report(ps0, "a", a, int(a["start"]), int(a["start"]) + 3, "a.1")
    assert len(journaled) == 2
    ps1.promote(0)
    assert _trained(ps1) == {"0": 3}
    assert ps1.lease({"worker": "b"})["piece"] == b["piece"]
