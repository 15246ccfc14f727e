"""The worker-side binding: touched rows only, and their gradients equal the full model's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ringwright.runtime.ps.model import PSModel
from ringwright.runtime.ps.partition import Kind


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(50, 3, mode="sum")
        self.emb = nn.Embedding(50, 3)
        self.out = nn.Linear(6, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.bag(ids), self.emb(ids).mean(1)], dim=1)
        out: torch.Tensor = self.out(x).sum()
        return out


def test_sparse_gradients_equal_the_rows_of_full_gradients() -> None:
    torch.manual_seed(0)
    full = Tiny()
    served = Tiny()
    served.load_state_dict(full.state_dict())
    binding = PSModel(served)
    assert {s.name: s.kind for s in binding.specs()} == {
        "bag.weight": Kind.EMBEDDING, "emb.weight": Kind.EMBEDDING,
        "out.weight": Kind.DENSE, "out.bias": Kind.DENSE}
    initial = {k: v.clone() for k, v in binding.initial().items()}
    binding.release_tables()
    ids = torch.tensor([[4, 9, 4], [30, 9, 2]])
    unique = torch.unique(ids)
    binding.load({"out.weight": initial["out.weight"], "out.bias": initial["out.bias"]},
                 {name: (unique, initial[name][unique]) for name in ("bag.weight", "emb.weight")})
    served(ids).backward()
    full(ids).backward()
    dense, sparse = binding.gradients()
    assert torch.allclose(dense["out.weight"], full.out.weight.grad)  # type: ignore[arg-type]
    for name, module in (("bag.weight", full.bag), ("emb.weight", full.emb)):
        got_ids, rows = sparse[name]
        assert torch.equal(got_ids, unique)
        assert module.weight.grad is not None
        assert torch.allclose(rows, module.weight.grad[unique])


def test_ids_that_were_not_pulled_are_an_error() -> None:
    binding = PSModel(Tiny())
    rows = torch.zeros(1, 3)
    binding.load({}, {"bag.weight": (torch.tensor([4]), rows),
                      "emb.weight": (torch.tensor([4]), rows)})
    with pytest.raises(KeyError, match="not pulled"):
        binding.model(torch.tensor([[4, 5]]))


def test_padding_idx_is_refused() -> None:
    with pytest.raises(ValueError, match="padding_idx"):
        PSModel(nn.Sequential(nn.Embedding(5, 2, padding_idx=0)))


def test_dense_targets_are_the_parameters_storage() -> None:
    model = Tiny()
    model.out.bias.data = model.out.bias.data.double()  # not what the servers hold
    binding = PSModel(model)
    targets = binding.dense_targets()
    assert set(targets) == {"out.weight"}
    assert targets["out.weight"].data_ptr() == model.out.weight.data_ptr()
    targets["out.weight"].fill_(2.0)  # what a pull into it does
    binding.load({"out.weight": targets["out.weight"], "out.bias": torch.ones(1)}, {})
    assert bool((model.out.weight == 2.0).all())
    assert model.out.bias.dtype == torch.float64 and float(model.out.bias.detach()) == 1.0
