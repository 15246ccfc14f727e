"""examples/ddp_plain.py made elastic with ringwright: same model, data and loader.

Run it under the local launcher (``python -m ringwright.runtime.local.launcher
--workers 2 -- python examples/ddp_ringwright.py``), in a TrainingJob, or alone with
``python examples/ddp_ringwright.py``; ``kill -9`` a worker and the others roll back to
their last commit and carry on. docs/porting.md walks through the difference. With
``TRAIN_LOG`` set, every step appends the sample indices it trained to that file (the
tests count them).
"""

from __future__ import annotations

import json
import os
import time

import torch
from torch.utils.data import DataLoader, Dataset

from ringwright.runtime import ElasticRuntime, ElasticSampler, State


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
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = State(model, optimizer, ElasticSampler(len(data), batch_size=16, seed=1))
    loader = DataLoader(data, batch_sampler=state.sampler, num_workers=2,
                        persistent_workers=True)

    def train(state: State) -> None:
        while (epoch := state.sampler.epoch) < epochs:
            for index, x, y in loader:
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                state.allreduce_gradients()
                optimizer.step()
                record(rank=state.rank, size=state.world_size, step=state.step + 1,
                       epoch=epoch, indices=index.tolist())
                state.advance()
                if state.step % 10 == 0 or state.sampler.epoch != epoch:
                    state.commit()
                time.sleep(step_sleep)
            if state.rank == 0:
                print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)

    with ElasticRuntime.from_env() as runtime:
        runtime.run(train, state)


if __name__ == "__main__":
    main()
