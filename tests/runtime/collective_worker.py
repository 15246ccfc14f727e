"""One rank of the collective-equivalence tests: real gloo through the runtime's backend.

Joins the world in ``$WORLD_FILE`` as ``$RANK`` with :class:`TorchDistributedBackend`
(which builds the rack groups when the world's topology asks for them) and compares,
on identical inputs, the runtime's paths against the flat ring:

* ``hierarchical``: ``backend.allreduce_`` vs ``dist.all_reduce`` on tensors of many
  sizes (fewer elements than shards included) and two dtypes;
* ``buckets``: gradients from :class:`GradientBuckets` (small buckets, so there are
  several) vs the unbucketed ``allreduce_gradients``, on a model with a parameter no
  rank uses and one that only rank 0 uses; once exact and once with bf16 compression.

Writes the largest differences and the grads that came back as None to ``$OUT``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ringwright.runtime.collectives.buckets import BucketSettings, Compression, GradientBuckets
from ringwright.runtime.collectives.hierarchical import rack_plan
from ringwright.runtime.collectives.torch_backend import TorchDistributedBackend
from ringwright.runtime.settings import RuntimeSettings
from ringwright.world import parse_world

SIZES = (1, 2, 5, 7, 64, 1000, 65_537, 700_001)
"""The largest goes through the pipeline in several pieces."""


class Net(torch.nn.Module):
    """Two used layers, a layer used only on rank 0, and one never used."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 4)
        self.only_rank0 = torch.nn.Linear(16, 4)
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        out: torch.Tensor = self.b(torch.tanh(self.a(x)))
        return out + self.only_rank0(x) if rank == 0 else out


def hierarchical_diff(backend: TorchDistributedBackend, rank: int) -> float:
    worst = 0.0
    for dtype in (torch.float32, torch.float64):
        for n in SIZES:
            gen = torch.Generator().manual_seed(1000 * rank + n)
            mine = torch.randn(n, generator=gen, dtype=dtype)
            flat = mine.clone()
            dist.all_reduce(flat)
            two_level = mine.clone()
            backend.allreduce_(two_level, "test")
            worst = max(worst, float((flat - two_level).abs().max()))
    return worst


def bucket_diff(backend: TorchDistributedBackend, rank: int, size: int,
                compression: Compression) -> tuple[float, list[str]]:
    torch.manual_seed(0)
    reference = Net()
    bucketed = copy.deepcopy(reference)
    buckets = GradientBuckets(bucketed.parameters(), lambda: backend,
                              BucketSettings(bucket_bytes=1024, compression=compression))
    worst = 0.0
    try:
        for step in range(3):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank * 10 + step))
            # One at a time: the buckets' collectives must not interleave with others.
            bucketed.zero_grad()
            bucketed(x, rank).square().sum().backward()
            buckets.finish(average_over=size)
            reference.zero_grad()
            reference(x, rank).square().sum().backward()
            backend.allreduce_gradients(reference.parameters(), average=True)
            for (name, p), q in zip(bucketed.named_parameters(), reference.parameters(),
                                    strict=True):
                if p.grad is None:
                    assert name.startswith("unused"), f"{name} lost its gradient"
                    continue
                assert q.grad is not None
                worst = max(worst, float((p.grad - q.grad).abs().max()))
    finally:
        buckets.close()
    return worst, [n for n, p in bucketed.named_parameters() if p.grad is None]


def main() -> int:
    world = parse_world(Path(os.environ["WORLD_FILE"]).read_text())
    rank = int(os.environ["RANK"])
    backend = TorchDistributedBackend(torch.device("cpu"),
                                      RuntimeSettings(collective_timeout_s=120))
    backend.init(world, rank, lambda: False, lambda failure: None)
    try:
        exact, none_grads = bucket_diff(backend, rank, world.size, Compression.NONE)
        compressed, _ = bucket_diff(backend, rank, world.size, Compression.BF16)
        result = {
            "rank": rank,
            "hierarchical": rack_plan(world) is not None,
            "hierarchical_diff": hierarchical_diff(backend, rank),
            "bucket_diff": exact,
            "bucket_bf16_diff": compressed,
            "none_grads": none_grads,
        }
        Path(os.environ["OUT"]).write_text(json.dumps(result))
    finally:
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
