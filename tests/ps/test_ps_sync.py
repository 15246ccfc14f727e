"""Sync mode on real PS and worker processes equals single-process training."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.ps.harness import LocalPSJob, consistency, load_example

ARGS = ["--samples", "1024", "--vocab", "200", "--dim", "4", "--batch-size", "32",
        "--piece-batches", "4", "--epochs", "1", "--optimizer", "adagrad",
        "--lr", "0.05"]


@pytest.fixture
def job(tmp_path: Path) -> Iterator[LocalPSJob]:
    j = LocalPSJob(tmp_path, servers=2, args=ARGS, env=consistency("Sync"))
    yield j
    j.close()


def test_sync_two_workers_equals_one_process_on_the_same_data_order(
        job: LocalPSJob, tmp_path: Path) -> None:
    final = tmp_path / "final.pt"
    job.start_all(["w0", "w1"], extra={"w0": ["--final", str(final)]})
    codes = job.wait_all()
    assert all(c == 0 for c in codes.values()), job.logs()
    served = torch.load(final)
    # The reference: one process, one optimizer, each round's two batches as one.
    example = load_example()
    args = example.parse(ARGS)
    ref = example.build(args)
    model: nn.Module = ref.model
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05, eps=1e-10)
    piece = 32 * 4
    for first in range(0, 1024, 2 * piece):
        for b in range(4):
            halves = [torch.arange(p + b * 32, p + (b + 1) * 32) for p in (first, first + piece)]
            opt.zero_grad()
            loss = sum(ref.loss(model, ref.fetch(idx)) for idx in halves) / 2
            loss.backward()
            opt.step()
    for name, param in model.named_parameters():
        diff = (served[name] - param.detach()).abs().max().item()
        assert diff < 1e-5, f"{name}: differs by {diff}"
    assert job.result("w0")["steps"] + job.result("w1")["steps"] == 1024 // 32
