"""Benchmark worker: a model of ``STATE_MB`` MB of training state (weights plus SGD
momentum) that commits every step and holds at step ``GATE_STEP`` while
``$GATE_DIR/<step>`` exists, so the benchmark can resize the job at a known commit.

Started by ``bench_checkpoint.py`` through the local launcher; the runtime's
``world_ready`` log lines say how many bytes each world's sync moved.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import torch

from ringwright.runtime.elastic import ElasticRuntime
from ringwright.runtime.sampler import ElasticSampler
from ringwright.runtime.state import State
from ringwright.world import Env

WIDTH = 2048


def main() -> int:
    pod = os.environ[Env.POD_NAME]
    state_mb = int(os.environ.get("STATE_MB", "1000"))
    steps = int(os.environ.get("STEPS", "6"))
    gates = Path(os.environ["GATE_DIR"])
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"%(asctime)s {pod} %(name)s %(message)s")
    # Weights and momentum: 8 bytes of state per parameter.
    layers = max(1, state_mb * 1_000_000 // (8 * WIDTH * WIDTH))
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, bias=False)
                                  for _ in range(layers)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
    # Allocate the momentum now (a zero step changes nothing), so that even the fresh
    # start's sync, the benchmark's baseline, moves the whole state.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    state = State(model, optimizer, ElasticSampler(10_000, 1))
    x = torch.randn(1, WIDTH)

    def train(state: State) -> None:
        while state.step < steps:
            optimizer.zero_grad()
            model(x).sum().backward()
            state.allreduce_gradients()
            optimizer.step()
            state.advance()
            while (gates / str(state.step)).exists():
                time.sleep(0.05)
            state.commit()

    with ElasticRuntime.from_env() as runtime:
        runtime.run(train, state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
