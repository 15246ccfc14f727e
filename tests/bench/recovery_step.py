"""The training step the torchrun and horovodrun workers share with ``elastic_worker.py``:
same data, same model, same optimizer, same per-rank share of each global batch."""

from __future__ import annotations

from typing import Any


def same_model(samples: int) -> tuple[Any, Any, Any, Any]:
    """The elastic tests' data and model, built identically under every launcher."""
    import torch

    from tests.runtime.elastic_worker import FEATURES

    data = torch.Generator().manual_seed(1234)
    xs = torch.randn(samples, FEATURES, generator=data)
    ys = xs @ torch.randn(FEATURES, 1, generator=data) + 0.1
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return xs, ys, model, optimizer


def local_gradients(model: Any, optimizer: Any, sampler: Any, xs: Any, ys: Any) -> list[Any]:
    """This rank's gradients for its share of the next batch (zeros when it has none),
    scaled so that summing them over the world gives the global mean loss's."""
    from ringwright.runtime.collectives.flat import gradients

    indices = sampler.batch()
    global_batch = len(sampler.global_positions())
    optimizer.zero_grad()
    if indices:
        (((model(xs[indices]) - ys[indices]) ** 2).sum() / global_batch).backward()
    return gradients(model.parameters())
