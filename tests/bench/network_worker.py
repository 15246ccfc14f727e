"""One member of the network benchmark, run inside its emulated host's namespace.

``$RUNS`` names a JSON list of ``{"task", "world", "env"}``; for each run this
process (pod ``$POD``) joins that run's world through the runtime's own
:class:`TorchDistributedBackend`, in the same process one world after the other as
the elastic runtime does (a world whose topology asks for it gets the rack groups),
then, by task:

* ``allreduce``: times ``backend.allreduce_`` on a ``$SIZE_MB`` float32 buffer,
  ``$ITERS`` times after one warm-up;
* ``train``: times training steps of one model three ways, interleaved round by
  round so that drift in the machine's load hits all alike: torch's
  DistributedDataParallel, ringwright's bucketed overlap (:class:`GradientBuckets`,
  the path ``State(buckets=...)`` takes) and the flat all-reduce after backward.

Rank 0 of each run writes the median seconds to ``$OUT_DIR/<run>.json``.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ringwright.runtime.collectives.buckets import BucketSettings, GradientBuckets
from ringwright.runtime.collectives.torch_backend import TorchDistributedBackend
from ringwright.runtime.settings import RuntimeSettings
from ringwright.world import parse_world


def timed(step: Callable[[], None]) -> float:
    """Seconds of one ``step``, every rank starting together."""
    dist.barrier()
    started = time.perf_counter()
    step()
    return time.perf_counter() - started


def allreduce_task(backend: TorchDistributedBackend, env: dict[str, str]
                   ) -> dict[str, float]:
    buf = torch.ones(int(float(env["SIZE_MB"]) * 2**20 / 4))

    def step() -> None:
        backend.allreduce_(buf, "bench")

    step()
    return {"seconds": statistics.median(timed(step) for _ in range(int(env["ITERS"])))}


def model(env: dict[str, str]) -> torch.nn.Sequential:
    torch.manual_seed(0)
    width = int(env["WIDTH"])
    layers: list[torch.nn.Module] = []
    for _ in range(int(env["LAYERS"])):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def train_task(backend: TorchDistributedBackend, size: int, env: dict[str, str]
               ) -> dict[str, float]:
    base = model(env)
    width = int(env["WIDTH"])
    x = torch.randn(int(env["BATCH"]), width)
    ddp = DistributedDataParallel(copy.deepcopy(base))
    bucketed = copy.deepcopy(base)
    buckets = GradientBuckets(bucketed.parameters(), lambda: backend, BucketSettings())
    flat = copy.deepcopy(base)

    def ddp_step() -> None:
        ddp.zero_grad()
        ddp(x).square().mean().backward()

    def bucket_step() -> None:
        bucketed.zero_grad()
        bucketed(x).square().mean().backward()
        buckets.finish(average_over=size)

    def flat_step() -> None:
        flat.zero_grad()
        flat(x).square().mean().backward()
        backend.allreduce_gradients(flat.parameters(), average=True)

    steps = {"ddp": ddp_step, "buckets": bucket_step, "flat_after_backward": flat_step}
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        step()
    for _ in range(int(env["ITERS"])):
        for name, step in steps.items():
            samples[name].append(timed(step))
    buckets.close()
    return {name: statistics.median(times) for name, times in samples.items()}


def main() -> int:
    runs = json.loads(Path(os.environ["RUNS"]).read_text())
    pod, out_dir = os.environ["POD"], Path(os.environ["OUT_DIR"])
    backend = TorchDistributedBackend(torch.device("cpu"),
                                      RuntimeSettings(collective_timeout_s=600))
    try:
        for i, run in enumerate(runs):
            world = parse_world(json.dumps(run["world"]))
            me = world.member(pod)
            assert me is not None, f"{pod} is not in run {i}"
            backend.init(world, me.rank, lambda: False, lambda failure: None)
            env: dict[str, str] = run["env"]
            if run["task"] == "train":
                result = train_task(backend, world.size, env)
            else:
                result = allreduce_task(backend, env)
            if me.rank == 0:
                (out_dir / f"{i}.json").write_text(json.dumps(result))
    finally:
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
