"""Primary shards are checkpointed in the background with the checkpoint module, and a
restarted job goes on from them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ringwright.runtime.checkpoint.checkpointer import Checkpointer, LocalStorage, ps_shard
from ringwright.runtime.ps.partition import Kind, TensorSpec
from ringwright.runtime.ps.process import ShardCheckpoints
from ringwright.runtime.ps.serving.consistency import Consistency, Mode
from ringwright.runtime.ps.serving.hosting import JobConfig
from ringwright.runtime.ps.serving.optim import OptimizerKind, ServerOptimizer
from ringwright.runtime.ps.serving.server import ParameterServer
from ringwright.runtime.ps.serving.shard import ShardState, initial_values


def test_checkpoint_every_n_versions_restores_the_shard(tmp_path: Path) -> None:
    specs = (TensorSpec("w", (6,)), TensorSpec("emb", (20, 2), kind=Kind.EMBEDDING))
    optimizer = ServerOptimizer(OptimizerKind.ADAM, lr=0.1)
    config = JobConfig(specs, 1, optimizer, Consistency(Mode.ASYNC, tau=9),
                       {"samples": 4, "pieceSize": 2, "epochs": 1})
    ps = ParameterServer(0)
    params = {"w": torch.randn(6), "emb": torch.randn(20, 2)}
    ps.init({"shard": 0, "config": config.to_json()},
            initial_values(config.partition(), 0, params))
    checkpoints = ShardCheckpoints(ps, str(tmp_path), every=2)
    for _ in range(3):
        ps.push({"shard": 0, "worker": "a", "version": 10**6},
                {"g/w@0": torch.ones(6), "i/emb": torch.tensor([5]), "r/emb": torch.ones(1, 2)})
        checkpoints.round()
    checkpoints.close()
    restored = Checkpointer(LocalStorage(tmp_path), shard=ps_shard(0)).restore_latest()
    assert restored is not None and restored.meta.step == 2  # every 2 versions: at 2, not 3
    state = ShardState.from_payload(config.partition(), 0, optimizer, restored.payload)
    assert int(state.tables["emb"].steps[state.tables["emb"].locate(torch.tensor([5]))]) == 2
    assert int(state.dense_steps["w@0"]) == 2


def _job(optimizer: ServerOptimizer) -> JobConfig:
    specs = (TensorSpec("w", (6,)), TensorSpec("emb", (20, 2), kind=Kind.EMBEDDING))
    return JobConfig(specs, 1, optimizer, Consistency(Mode.ASYNC, tau=9),
                     {"samples": 40, "pieceSize": 10, "epochs": 2})


def test_a_restarted_job_goes_on_from_the_checkpoint_with_its_data_queue(
        tmp_path: Path) -> None:
    config = _job(ServerOptimizer(OptimizerKind.ADAGRAD, lr=0.1))
    params = {"w": torch.zeros(6), "emb": torch.zeros(20, 2)}
    now = [0.0]
    ps = ParameterServer(0)
    ps.init({"shard": 0, "config": config.to_json()},
            initial_values(config.partition(), 0, params))
    ps.set_workers(frozenset({"a"}))
    checkpoints = ShardCheckpoints(ps, str(tmp_path), seconds=10.0, clock=lambda: now[0])
    lease = ps.lease({"worker": "a"})
    ps.push({"shard": 0, "worker": "a", "version": 0,
             "data": {"piece": lease["piece"], "start": 0, "stop": 4}},
            {"g/w@0": torch.ones(6), "i/emb": torch.tensor([1]), "r/emb": torch.ones(1, 2)})
    checkpoints.round()
    now[0] = 10.0  # due by time, and the shard changed since the start
    checkpoints.round()
    checkpoints.close()
    # Every server of the job is gone; a new one finds the checkpoint.
    fresh = ParameterServer(0)
    fresh.set_workers(frozenset({"a"}))
    restored = ShardCheckpoints(fresh, str(tmp_path))
    assert restored.restore(0) == 1
    restored.close()
    reply = fresh.init({"shard": 0, "config": config.to_json()},
                       initial_values(config.partition(), 0, params))
    assert reply == {"created": False, "version": 1}  # the worker's first values lose
    assert torch.equal(fresh.hosted[0].state.dense["w@0"], ps.hosted[0].state.dense["w@0"])
    again = fresh.lease({"worker": "a"})  # the piece it held, from its next sample
    assert (again["piece"], again["start"]) == (lease["piece"], 4)
    assert fresh.status()["data"]["trained"] == {"0": 4}


def test_a_checkpoint_of_another_model_is_refused_with_what_to_do(tmp_path: Path) -> None:
    config = _job(ServerOptimizer(OptimizerKind.ADAM, lr=0.1))
    ps = ParameterServer(0)
    params = {"w": torch.zeros(6), "emb": torch.zeros(20, 2)}
    ps.init({"shard": 0, "config": config.to_json()},
            initial_values(config.partition(), 0, params))
    checkpoints = ShardCheckpoints(ps, str(tmp_path), every=1)
    ps.push({"shard": 0, "worker": "a", "version": 0}, {"g/w@0": torch.ones(6)})
    checkpoints.round()
    checkpoints.close()
    fresh = ParameterServer(0)
    ShardCheckpoints(fresh, str(tmp_path)).restore(0)
    other = _job(ServerOptimizer(OptimizerKind.SGD, lr=0.1))
    with pytest.raises(ValueError, match="Train the model the checkpoint was written for"):
        fresh.init({"shard": 0, "config": other.to_json()},
                   initial_values(other.partition(), 0, params))
