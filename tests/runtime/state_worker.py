"""A real training worker whose state has everything a resize must carry.

A dropout model trained with AdamW under a OneCycleLR schedule, with a
``torch.amp.GradScaler`` and a user counter joining the state by name, and shared RNG
(dropout masks are drawn from the committed generators). It follows the world file of
the local launcher and appends JSON lines to ``$TRACE_DIR/<pod>.jsonl``: the start of
every world (digests of the parameters, the optimizer's moments, the schedule and the
scaler), every commit, and the final parameters. It never builds a checkpointer: a job
that wants checkpoints sets ``spec.checkpoint`` (the launcher's ``checkpoint=``).

Environment: EPOCHS, SAMPLES, BATCH, COMMIT_EVERY, STEP_SLEEP; GATE_DIR: a worker
that completes step N waits while ``$GATE_DIR/N`` exists, so a test can make a change
happen at a known step without racing it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.optim import lr_scheduler

from ringwright.runtime.elastic import ElasticRuntime
from ringwright.runtime.sampler import ElasticSampler
from ringwright.runtime.state import State, Terminated
from ringwright.world import Env
from tests.runtime.elastic_worker import Trace, param_hash

FEATURES = 8


class SeenSamples:
    """A user counter that joins the state by name."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.count = int(state["count"])


def new_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(),
                               torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))


def digest(obj: Any) -> str:
    """A digest of nested tensors and values: equal only if bit-identical."""
    h = hashlib.sha256()

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            h.update(o.detach().cpu().contiguous().numpy().tobytes())
        elif isinstance(o, dict):
            for k in sorted(o, key=str):
                h.update(str(k).encode())
                walk(o[k])
        elif isinstance(o, list | tuple):
            for v in o:
                walk(v)
        else:
            h.update(repr(o).encode())

    walk(obj)
    return h.hexdigest()[:16]


def main() -> int:
    pod = os.environ[Env.POD_NAME]
    epochs = int(os.environ.get("EPOCHS", "2"))
    samples = int(os.environ.get("SAMPLES", "192"))
    batch = int(os.environ.get("BATCH", "4"))
    commit_every = int(os.environ.get("COMMIT_EVERY", "4"))
    step_sleep = float(os.environ.get("STEP_SLEEP", "0.02"))
    gates = Path(os.environ.get("GATE_DIR", "/nonexistent"))
    trace = Trace(Path(os.environ["TRACE_DIR"]) / f"{pod}.jsonl")
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"%(asctime)s {pod} %(name)s %(message)s")

    data = torch.Generator().manual_seed(1234)
    xs = torch.randn(samples, FEATURES, generator=data)
    ys = xs @ torch.randn(FEATURES, 1, generator=data) + 0.1

    # Different weights and generators on every pod: only the sync makes them agree.
    torch.manual_seed(int(hashlib.sha256(pod.encode()).hexdigest()[:8], 16))
    model = new_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    total = epochs * samples  # an upper bound on steps, for the schedule's length
    schedule = lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=total)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    seen = SeenSamples()
    state = State(model, optimizer, ElasticSampler(samples, batch, seed=7),
                  schedule=schedule, scaler=scaler, seen=seen)

    def record_start(state: State) -> None:
        world = state.binding.world
        trace.write(ev="start", generation=world.generation, size=world.size,
                    rank=state.binding.rank, step=state.step, hash=param_hash(model),
                    optimizer=digest(optimizer.state_dict()["state"]),
                    schedule=digest(schedule.state_dict()), scaler=scaler.state_dict(),
                    seen=seen.count, lr=state.lr.scaled_lrs()[0], pid=os.getpid())

    def train(state: State) -> None:
        record_start(state)
        world = state.binding.world
        while state.sampler.epoch < epochs:
            data_epoch = state.sampler.epoch
            global_batch = len(state.sampler.global_positions())
            indices = state.sampler.batch()
            optimizer.zero_grad()
            if indices:
                loss = ((model(xs[indices]) - ys[indices]) ** 2).sum() / global_batch
                scaler.scale(loss).backward()
            state.allreduce_gradients(average=False)
            scaler.step(optimizer)
            scaler.update()
            schedule.step()
            seen.count += len(state.sampler.global_positions())
            state.advance()
            trace.write(ev="stepped", generation=world.generation, size=world.size, step=state.step,
                        rank=state.binding.rank)
            time.sleep(step_sleep)
            while (gates / str(state.step)).exists():
                time.sleep(0.02)
            if state.step % commit_every == 0 or state.sampler.epoch != data_epoch:
                try:
                    state.commit()
                finally:
                    trace.write(ev="commit", generation=world.generation, rank=state.binding.rank,
                                step=state.step, hash=param_hash(model))

    with ElasticRuntime.from_env() as runtime:
        try:
            runtime.run(train, state)
        except Terminated as term:
            trace.write(ev="terminated", step=term.step, flushed=term.flushed,
                        synced_rank=state.synced_rank, hash=param_hash(model))
            raise
    trace.write(ev="done", step=state.step, hash=param_hash(model),
                params=[p.detach().reshape(-1).tolist() for p in model.parameters()],
                scaler=scaler.state_dict(), seen=seen.count,
                optimizer=digest(optimizer.state_dict()["state"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
