"""A plain DDP script: DistributedSampler + DataLoader over synthetic data.

Run it the usual way (``torchrun --nproc-per-node 2 examples/ddp_plain.py``, or set
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` yourself); it trains on
CPU with gloo. ``examples/ddp_ringwright.py`` is the same script made elastic, and
docs/porting.md walks through the difference. With ``TRAIN_LOG`` set, every step
appends the sample indices it trained to that file (the tests count them).
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Synthetic(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """A noisy linear function; each sample comes with its index."""

    def __init__(self, samples: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(samples, 16, generator=gen)
        self.y = self.x @ torch.randn(16, 1, generator=gen) + 0.05

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def record(**fields: object) -> None:
    """Append one JSON line to ``$TRAIN_LOG`` (one write: a killed process tears none)."""
    if path := os.environ.get("TRAIN_LOG"):
        with open(path, "a") as log:
            log.write(json.dumps({"t": time.time(), **fields}) + "\n")


def main() -> None:
    epochs = int(os.environ.get("EPOCHS", "3"))
    step_sleep = float(os.environ.get("STEP_SLEEP", "0"))
    data = Synthetic(int(os.environ.get("SAMPLES", "1024")))
    dist.init_process_group("gloo")
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    sampler = DistributedSampler(data, shuffle=True, seed=1)
    loader = DataLoader(data, batch_size=16, sampler=sampler, num_workers=2,
                        persistent_workers=True)
    step = 0

    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for index, x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            step += 1
            record(rank=dist.get_rank(), size=dist.get_world_size(), step=step,
                   epoch=epoch, indices=index.tolist())
            time.sleep(step_sleep)
        if dist.get_rank() == 0:
            print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
