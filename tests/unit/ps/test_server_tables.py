"""Tables the servers create row by row (a table on the meta device): rows exist only
once used, their first values depend on the row id alone, and replicas, checkpoints and
a second server agree on them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ringwright.runtime.ps.model import PSModel
from ringwright.runtime.ps.partition import Kind, TensorSpec, partition
from ringwright.runtime.ps.serving.consistency import Consistency, Mode
from ringwright.runtime.ps.serving.hosting import JobConfig
from ringwright.runtime.ps.serving.optim import OptimizerKind, ServerOptimizer
from ringwright.runtime.ps.serving.rowinit import initial_rows
from ringwright.runtime.ps.serving.server import ParameterServer
from ringwright.runtime.ps.serving.shard import ShardState, initial_values

ROWS, DIM = 1_000_000, 8
SPECS = (TensorSpec("w", (3,)), TensorSpec("emb", (ROWS, DIM), kind=Kind.EMBEDDING,
                                           init_std=0.5))


def test_initial_rows_depend_on_the_row_alone_and_have_the_asked_spread() -> None:
    ids = torch.arange(20_000)
    rows = initial_rows("emb", ids, DIM, 0.5)
    # The same rows asked in another order, in smaller calls, come out the same.
    shuffled = torch.randperm(len(ids), generator=torch.Generator().manual_seed(1))
    again = torch.cat([initial_rows("emb", part, DIM, 0.5)
                       for part in torch.split(ids[shuffled], 777)])
    assert torch.equal(again, rows[shuffled])
    assert abs(float(rows.mean())) < 0.01 and abs(float(rows.std()) - 0.5) < 0.01
    # Columns and tables differ: no two elements of a row repeat, nor two tables.
    assert len(torch.unique(rows[0])) == DIM
    assert not torch.equal(initial_rows("other", ids[:10], DIM, 0.5), rows[:10])


def _config(shards: int = 1) -> JobConfig:
    return JobConfig(SPECS, shards, ServerOptimizer(OptimizerKind.ADAGRAD, lr=0.1),
                     Consistency(Mode.ASYNC, tau=9), {"samples": 4, "pieceSize": 2, "epochs": 1})


def _server(config: JobConfig, index: int = 0) -> ParameterServer:
    ps = ParameterServer(index)
    ps.init({"shard": index, "config": config.to_json()},
            initial_values(config.partition(), index, {"w": torch.zeros(3)}))
    return ps


def test_a_shard_holds_only_the_rows_used_and_creates_them_as_the_row_ids_say() -> None:
    config = _config()
    ps = _server(config)
    ids = torch.tensor([999_999, 5, 123_456])
    _, pulled = ps.pull({"shard": 0, "dense": False}, {"i/emb": ids})
    assert torch.equal(pulled["emb"], initial_rows("emb", ids, DIM, 0.5))
    table = ps.hosted[0].state.tables["emb"]
    assert sorted(table.rows.tolist()) == sorted(ids.tolist())
    # A push to rows not pulled yet creates them too, then applies to them.
    ps.push({"shard": 0, "worker": "a", "version": 0},
            {"i/emb": torch.tensor([5, 77]), "r/emb": torch.ones(2, DIM)})
    assert len(table.rows) == 4
    _, after = ps.pull({"shard": 0, "dense": False}, {"i/emb": torch.tensor([77, 123_456])})
    assert not torch.equal(after["emb"][0], initial_rows("emb", torch.tensor([77]), DIM,
                                                         0.5)[0])
    assert torch.equal(after["emb"][1], pulled["emb"][2])  # untouched by the push
    # The buffers grew for a handful of rows, not for the table.
    assert table.values.untyped_storage().nbytes() < ROWS * DIM * 4 // 100


def test_the_rows_held_survive_a_payload_round_trip_and_grow_afterwards() -> None:
    config = _config()
    optimizer = config.optimizer
    state = ShardState(config.partition(), 0, optimizer, {"w@0": torch.zeros(3)})
    state.apply({}, {"emb": (torch.tensor([2, 40, 9]), torch.ones(3, DIM))}, 1.0)
    copy = ShardState.from_payload(config.partition(), 0, optimizer, state.payload())
    for name in ("emb",):
        a, b = state.tables[name], copy.tables[name]
        assert torch.equal(a.rows, b.rows) and torch.equal(a.values, b.values)
        assert torch.equal(a.steps, b.steps)
        assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)
    # Both go on the same way, rows they never held included.
    step = {"emb": (torch.tensor([40, 41]), torch.full((2, DIM), 0.5))}
    state.apply({}, step, 1.0)
    copy.apply({}, step, 1.0)
    ids = torch.tensor([2, 40, 41, 9])
    assert torch.equal(state.read(False, {"emb": ids})["emb"],
                       copy.read(False, {"emb": ids})["emb"])


def test_a_row_of_another_shard_is_refused_not_created() -> None:
    config = _config(shards=2)
    placed = partition(SPECS, 2)
    ids = torch.arange(100)
    theirs = ids[torch.from_numpy(placed.row_shards("emb", ids.numpy())) == 1][:1]
    state = ShardState(placed, 0, config.optimizer, initial_values(placed, 0, {
        "w": torch.zeros(3)}))
    with pytest.raises(KeyError):
        state.read(False, {"emb": theirs})
    assert len(state.tables["emb"].rows) == 0


def test_a_meta_table_is_declared_for_the_servers_and_never_sent() -> None:
    model = nn.Sequential(nn.Embedding(ROWS, DIM, device="meta"), nn.Linear(DIM, 1))
    binding = PSModel(model, {"0.weight": 0.01})
    spec = {s.name: s for s in binding.specs()}["0.weight"]
    assert spec.lazy and spec.init_std == 0.01
    assert "0.weight" not in binding.initial() and "1.weight" in binding.initial()
    assert {s.name: s for s in PSModel(model).specs()}["0.weight"].init_std == 1.0
    with pytest.raises(ValueError, match="meta device"):
        PSModel(nn.Sequential(nn.Embedding(10, 2)), {"0.weight": 0.1})


def test_the_job_config_carries_the_spread_and_reads_configs_without_it() -> None:
    config = _config()
    assert JobConfig.from_json(config.to_json()) == config
    doc = config.to_json()
    doc["specs"] = [spec[:4] for spec in doc["specs"]]  # as written before tables were lazy
    assert not any(s.lazy for s in JobConfig.from_json(doc).specs)
