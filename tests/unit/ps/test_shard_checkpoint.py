"""Primary shards are checkpointed in the background with the checkpoint module."""

from __future__ import annotations

from pathlib import Path

import torch

from ringwright.runtime.checkpoint import Checkpointer, LocalStorage, ps_shard
from ringwright.runtime.ps.consistency import Consistency, Mode
from ringwright.runtime.ps.hosting import JobConfig
from ringwright.runtime.ps.optim import OptimizerKind, ServerOptimizer
from ringwright.runtime.ps.partition import Kind, TensorSpec
from ringwright.runtime.ps.process import ShardCheckpoints
from ringwright.runtime.ps.server import ParameterServer
from ringwright.runtime.ps.shard import ShardState, initial_values


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
