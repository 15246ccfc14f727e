"""The PS state machine without transport: consistency, optimizers, replicas, codec."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from ringwright.runtime.ps.partition import Kind, TensorSpec
from ringwright.runtime.ps.serving.consistency import Consistency, Mode
from ringwright.runtime.ps.serving.hosting import JobConfig, NotServing
from ringwright.runtime.ps.serving.optim import OptimizerKind, ServerOptimizer
from ringwright.runtime.ps.serving.server import COPY_NICE, ParameterServer
from ringwright.runtime.ps.serving.shard import Lent, initial_values
from ringwright.runtime.ps.wire.codec import decode, encode, from_frames, to_frames

SPECS = (TensorSpec("w", (4, 3)), TensorSpec("emb", (50, 2), kind=Kind.EMBEDDING))


def _server(consistency: Consistency, optimizer: ServerOptimizer | None = None,
            workers: tuple[str, ...] = ("a", "b")) -> tuple[ParameterServer, JobConfig]:
    config = JobConfig(SPECS, 1, optimizer or ServerOptimizer(lr=0.1), consistency,
                       {"samples": 100, "pieceSize": 10, "epochs": 1})
    ps = ParameterServer(0)
    params = {"w": torch.zeros(4, 3), "emb": torch.zeros(50, 2)}
    ps.init({"shard": 0, "config": config.to_json()},
            initial_values(config.partition(), 0, params))
    ps.set_workers(frozenset(workers))
    return ps, config


def _pull(ps: ParameterServer, header: dict[str, object],
          tensors: dict[str, torch.Tensor]) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    return ps.pull(header, tensors)


def _push(ps: ParameterServer, worker: str, version: int, value: float = 1.0) -> str:
    grads = {"g/w@0": torch.full((12,), value), "i/emb": torch.tensor([3, 7]),
             "r/emb": torch.full((2, 2), value)}
    verdict = ps.push({"shard": 0, "worker": worker, "version": version}, grads)["verdict"]
    assert isinstance(verdict, str)
    return verdict


def test_async_drops_exactly_the_pushes_older_than_tau() -> None:
    ps, _ = _server(Consistency(Mode.ASYNC, tau=2))
    verdicts = []
    # Versions advance by one per applied push; push i was computed from version 0.
    for _ in range(6):
        verdicts.append(_push(ps, "a", 0))
    # Staleness 0, 1, 2 apply (versions 0..2 -> 3); then 3 > tau: every later one drops.
    assert verdicts == ["apply", "apply", "apply", "stale", "stale", "stale"]
    status = ps.status()
    assert (status["applied"], status["stale"]) == (3, 3)
    assert status["staleness"] == {"0": 1, "1": 1, "2": 1}
    header, _ = _pull(ps, {"shard": 0, "dense": True}, {})
    assert header["version"] == 3


def test_sync_round_applies_the_mean_once_everyone_pushed() -> None:
    ps, _ = _server(Consistency(Mode.SYNC))
    assert _push(ps, "a", 0, 1.0) == "buffer"
    assert _push(ps, "a", 0, 1.0) == "duplicate"
    assert _push(ps, "b", 0, 3.0) == "apply"
    header, values = _pull(ps, {"shard": 0, "minVersion": 1}, {"i/emb": torch.tensor([3, 4])})
    assert header["version"] == 1
    assert torch.allclose(values["w@0"], torch.full((12,), -0.2))  # lr 0.1 * mean 2
    assert torch.allclose(values["emb"], torch.tensor([[-0.2, -0.2], [0.0, 0.0]]))
    assert _push(ps, "b", 0) == "stale"  # a late push for a finished round


def test_sync_backup_workers_complete_with_k_of_n_and_drop_the_late_one() -> None:
    ps, _ = _server(Consistency(Mode.SYNC, backup_workers=1), workers=("a", "b", "c"))
    assert _push(ps, "a", 0) == "buffer"
    assert _push(ps, "b", 0) == "apply"
    assert _push(ps, "c", 0) == "stale"


def test_sync_round_completes_when_a_worker_leaves() -> None:
    ps, _ = _server(Consistency(Mode.SYNC))
    assert _push(ps, "a", 0) == "buffer"
    ps.set_workers(frozenset({"a"}))
    assert _pull(ps, {"shard": 0, "minVersion": 1, "timeout": 0.0}, {})[0]["version"] == 1


@pytest.mark.parametrize("kind", [OptimizerKind.SGD, OptimizerKind.ADAGRAD, OptimizerKind.ADAM])
def test_server_optimizers_match_torch_on_dense(kind: OptimizerKind) -> None:
    torch.manual_seed(0)
    start = torch.randn(4, 3)
    grads = [torch.randn(4, 3) for _ in range(5)]
    param = torch.nn.Parameter(start.clone())
    reference: torch.optim.Optimizer
    if kind is OptimizerKind.SGD:
        reference = torch.optim.SGD([param], lr=0.1)
    elif kind is OptimizerKind.ADAGRAD:
        reference = torch.optim.Adagrad([param], lr=0.1, eps=1e-10)
    else:
        reference = torch.optim.Adam([param], lr=0.1, eps=1e-8)
    ps, _ = _server(Consistency(Mode.ASYNC, tau=100),
                         ServerOptimizer(kind, lr=0.1, eps=1e-10 if kind != "adam" else 1e-8),
                         workers=("a",))
    ps.hosted[0].state.dense["w@0"].copy_(start.reshape(1, -1))
    for g in grads:
        param.grad = g.clone()
        reference.step()
        ps.push({"shard": 0, "worker": "a", "version": 10**6}, {"g/w@0": g.reshape(-1)})
    _, values = _pull(ps, {"shard": 0}, {})
    diff = (values["w@0"].reshape(4, 3) - param.detach()).abs().max().item()
    assert diff <= 1e-5, diff


def test_adam_counts_steps_per_row() -> None:
    ps, _ = _server(Consistency(Mode.ASYNC, tau=100),
                    ServerOptimizer(OptimizerKind.ADAM, lr=0.1), workers=("a",))
    for _ in range(3):
        ps.push({"shard": 0, "worker": "a", "version": 10**6},
                {"i/emb": torch.tensor([1]), "r/emb": torch.ones(1, 2)})
    ps.push({"shard": 0, "worker": "a", "version": 10**6},
            {"i/emb": torch.tensor([2]), "r/emb": torch.ones(1, 2)})
    table = ps.hosted[0].state.tables["emb"]
    steps = table.steps[table.locate(torch.tensor([1, 2, 3]))].tolist()
    assert steps == [3, 1, 0]
    # A row's first Adam step moves it by lr whatever other rows did.
    _, values = _pull(ps, {"shard": 0, "dense": False}, {"i/emb": torch.tensor([2])})
    assert torch.allclose(values["emb"], torch.full((1, 2), -0.1), atol=1e-6)


def test_replica_promotes_with_state_and_data_queue() -> None:
    ps, _ = _server(Consistency(Mode.ASYNC, tau=5))
    lease = ps.lease({"worker": "a"})
    _push(ps, "a", 0)
    snap = ps.snapshot(0)
    assert snap is not None and ps.snapshot(0) is None  # unchanged since: nothing to send
    backup = ParameterServer(1)
    backup.replicate(*snap)
    backup.set_workers(frozenset({"b"}))
    with pytest.raises(NotServing):
        _pull(backup, {"shard": 0}, {})
    assert backup.promote(0)["version"] == 1
    _, values = _pull(backup, {"shard": 0}, {})
    assert torch.allclose(values["w@0"], torch.full((12,), -0.1))
    # "a" left with its piece: the promoted data service gives it to "b".
    again = backup.lease({"worker": "b"})
    assert (again["piece"], again["start"]) == (lease["piece"], lease["start"])


def test_codec_roundtrip_keeps_dtypes_shapes_and_header() -> None:
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5), "c": torch.zeros(0, 2),
               "d": torch.randn(2).to(torch.bfloat16), "e": torch.tensor(1.5)}
    header, out = decode(encode({"x": [1, "y"]}, tensors))
    assert header == {"x": [1, "y"]}
    frames = to_frames({"x": [1, "y"]}, tensors)
    # The data plane's frames are the tensors' own memory (no copy on the way out).
    assert all(memoryview(f).nbytes == t.nbytes for f, t in zip(frames[1:], tensors.values(),
                                                                 strict=True))
    doc, framed = from_frames([bytes(f) for f in frames])
    assert doc == {"x": [1, "y"]}
    for got in (out, framed):
        for name, t in tensors.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape
            assert torch.equal(got[name], t)


def test_dense_tensors_lent_to_a_reply_are_copied_on_write_until_returned() -> None:
    ps, _ = _server(Consistency(Mode.ASYNC, tau=10))
    header, lent = ps.pull({"shard": 0, "dense": True}, {})
    before = {k: v.clone() for k, v in lent.items()}
    assert isinstance(lent, Lent)
    _push(ps, "a", int(header["version"]))
    # The reply still being sent keeps the values it was given.
    assert all(torch.equal(lent[k], before[k]) for k in lent)
    _, after = ps.pull({"shard": 0, "dense": True}, {})
    assert not all(torch.equal(after[k], before[k]) for k in after)
    # Returned (sent): the next update writes the shard's tensors in place.
    assert isinstance(after, Lent)
    after.loan.until(lambda: True)
    _push(ps, "a", int(header["version"]) + 1)
    _, latest = ps.pull({"shard": 0, "dense": True}, {})
    assert all(latest[k].data_ptr() == after[k].data_ptr() for k in after)
    assert not all(torch.equal(latest[k], before[k]) for k in latest)


def test_whole_copies_run_at_a_lower_cpu_priority_than_serving() -> None:
    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    ps = ParameterServer(0)
    copying = ps._copier.submit(niceness).result()
    assert copying == min(19, niceness() + COPY_NICE)
