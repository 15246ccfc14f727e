"""Benchmark: how long a checkpoint stalls training, against the obvious alternatives.

For a training state of each size (model weights plus Adam's two moments, as many
tensors as a real model has) it measures, in one run on one machine:

* raw copy: cloning every tensor into fresh memory, the least a snapshot could cost
  without reusing buffers;
* save() stall: the time ``Checkpointer.save`` blocks the training loop, for the first
  save (buffer allocated) and later ones (buffer reused);
* background write: from save() returning to the checkpoint being durable on disk;
* training slowdown while writing: how much slower a CPU training step runs while that
  write is in flight, with the writer thread at its default lower priority (goal <= 20 %)
  and, as the baseline, at normal priority;
* torch.save: a synchronous save of the same state, the stall without this module
  (with and without the fsync that makes it durable);
* restore: ``restore_latest`` (read, verify, rebuild) against ``torch.load``, both with
  the files evicted from the page cache, as after a pod restart;
* bytes moved on a scale-down: three real worker processes (local launcher, gloo on
  loopback) holding ``--scale-down-mb`` of state each go to two at a commit; the bytes
  that world's sync moved (goal 0), against the bytes the fresh start's sync moved in
  the same run (the baseline: a full sync of the same state).

Run: ``python tests/bench/bench_checkpoint.py`` (``--sizes-mb 100,1000 --repeats 3
--scale-down-mb 1000``). Needs about 4x the largest size in memory and 3x on disk under
``--dir``, and about 10x ``--scale-down-mb`` in memory for the scale-down.
"""

from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ringwright.runtime.checkpoint.checkpointer import WRITER_NICE, Checkpointer, LocalStorage
from ringwright.runtime.local.launcher import LocalJob

HIDDEN = 1024


def build_state(megabytes: int) -> dict[str, Any]:
    """Weights plus Adam moments totalling about ``megabytes`` MB of float32."""
    params = megabytes * 1_000_000 // 12  # each parameter: weight + exp_avg + exp_avg_sq
    per_layer = HIDDEN * HIDDEN + HIDDEN
    layers = max(1, round(params / per_layer))
    model: dict[str, torch.Tensor] = {}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i in range(layers):
        for j, (name, shape) in enumerate(
            ((f"layer{i}.weight", (HIDDEN, HIDDEN)), (f"layer{i}.bias", (HIDDEN,)))
        ):
            model[name] = torch.randn(shape)
            state[2 * i + j] = {
                "step": torch.tensor(100.0),
                "exp_avg": torch.randn(shape),
                "exp_avg_sq": torch.rand(shape),
            }
    return {
        "model": model,
        "optimizer": {
            "state": state,
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": list(state)}],
        },
        "sampler": {"epoch": 3, "position": 123_456},
        "counters": {"step": 100},
    }


def state_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(state_bytes(v) for v in obj)
    return 0


def clone_all(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: clone_all(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(clone_all(v) for v in obj)
    return obj


def timed(action: Callable[[], Any]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def evict(paths: Iterator[Path]) -> None:
    """Drop files from the page cache (clean pages only, so fsync first)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def torch_save_durable(state: dict[str, Any], path: Path) -> None:
    with path.open("wb") as out:
        torch.save(state, out)
        out.flush()
        os.fsync(out.fileno())


class TrainingStep:
    """A CPU training step of a small MLP: forward, backward, optimizer step."""

    def __init__(self) -> None:
        self.model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                         torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                         torch.nn.Linear(512, 1))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.x, self.y = torch.randn(256, 512), torch.randn(256, 1)

    def __call__(self) -> None:
        self.optimizer.zero_grad()
        torch.autograd.backward(torch.nn.functional.mse_loss(self.model(self.x), self.y))
        self.optimizer.step()


def step_time(step: TrainingStep, until: Callable[[], bool] | None = None) -> float:
    """Mean time of a training step, over 30 steps or until ``until`` says stop."""
    steps, started = 0, time.perf_counter()
    while True:
        step()
        steps += 1
        if (until is None and steps == 30) or (until is not None and until()):
            break
    return (time.perf_counter() - started) / steps


def measure_checkpointer(state: dict[str, Any], repeats: int, folder: Path) -> dict[str, float]:
    result: dict[str, float] = {}
    ckpt = Checkpointer(LocalStorage(folder), keep=1)
    stalls, handed_over, writes = [], [], []
    for step in range(repeats + 1):
        stalls.append(timed(functools.partial(ckpt.save, step, state, {"world_size": 8})))
        writes.append(timed(ckpt.flush))
    for step in range(repeats):
        handed_over.append(timed(functools.partial(ckpt.save, step, state, copy=False)))
        ckpt.flush()
    result["save() stall, first"] = stalls[0]
    result["save() stall"] = statistics.median(stalls[1:])
    result["save(copy=False) stall"] = statistics.median(handed_over)
    result["write until durable"] = statistics.median(writes[1:])

    ckpt.close()
    # The write runs beside training: how much slower does a CPU step get meanwhile?
    # At normal priority (the baseline) and at the writer's default low priority.
    work = TrainingStep()
    for label, nice in (("training slower while writing, normal priority (%)", 0),
                        ("training slower while writing (%)", WRITER_NICE)):
        writer = Checkpointer(LocalStorage(folder), keep=1, writer_nice=nice)
        slowdowns = []
        for step in range(repeats):
            idle = step_time(work)
            writer.save(step, state, copy=False)
            done = functools.partial(writer.flush, timeout=0)
            slowdowns.append(step_time(work, until=done) / idle - 1)
        writer.close()
        result[label] = 100 * statistics.median(slowdowns)
    return result


def measure_restore(reference: Path, folder: Path, repeats: int) -> dict[str, float]:
    restores, loads = [], []
    reader = Checkpointer(LocalStorage(folder))
    for _ in range(repeats):
        evict((folder / "model").iterdir())
        restores.append(timed(reader.restore_latest))
        gc.collect()
        evict(iter([reference]))
        loads.append(timed(lambda: torch.load(reference, weights_only=True)))
        gc.collect()
    return {
        "restore_latest (cold cache)": statistics.median(restores),
        "torch.load (cold cache)": statistics.median(loads),
    }


def measure(megabytes: int, repeats: int, root: Path) -> dict[str, float]:
    """Every measurement for a state of about ``megabytes`` MB."""
    state = build_state(megabytes)
    folder = root / f"{megabytes}mb"
    folder.mkdir()
    result = {"state size (MB)": state_bytes(state) / 1e6}
    copies = []
    for _ in range(repeats):
        copies.append(timed(lambda: clone_all(state)))
        gc.collect()
    result["raw copy (clone)"] = statistics.median(copies)
    result.update(measure_checkpointer(state, repeats, folder / "ckpt"))

    reference = folder / "torch.pt"
    saved, durable = [], []
    for _ in range(repeats):
        saved.append(timed(lambda: torch.save(state, reference)))
        reference.unlink()
        durable.append(timed(lambda: torch_save_durable(state, reference)))
    result["torch.save"] = statistics.median(saved)
    result["torch.save + fsync"] = statistics.median(durable)
    state.clear()
    gc.collect()
    result.update(measure_restore(reference, folder / "ckpt", repeats))
    shutil.rmtree(folder)
    return result


def checksum_rates() -> dict[str, float]:
    """GB/s of each data checksum the manifest may name, on 256 MB."""
    data = memoryview(torch.randint(0, 255, (256 << 20,), dtype=torch.uint8).numpy().data)
    chunk = 16 << 20

    def crc32() -> None:
        value = 0
        for start in range(0, len(data), chunk):
            value = zlib.crc32(data[start : start + chunk], value)

    def sha256() -> None:
        digest = hashlib.sha256()
        for start in range(0, len(data), chunk):
            digest.update(data[start : start + chunk])

    return {"crc32": len(data) / timed(crc32) / 1e9, "sha256": len(data) / timed(sha256) / 1e9}


SYNCED = re.compile(r" world_ready .*?\bgeneration=(\d+)\b.*?\bsynced_bytes=(\d+)")


def measure_scale_down(state_mb: int, root: Path) -> dict[int, list[int]]:
    """Bytes each member's sync moved, per world generation, for a 3 -> 2 scale-down at a commit.

    Generation 0 is the fresh start (every member adopts rank 0's state: a full sync), generation
    1 the scale-down. Raises when the job does not finish cleanly.
    """
    workdir = root / "scale-down"
    gates = workdir / "gates"
    gates.mkdir(parents=True)
    held = gates / "2"
    held.touch()
    env = {"STATE_MB": str(state_mb), "STEPS": "4", "GATE_DIR": str(gates),
           "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR",
           # A 0.5 GB gradient allreduce on a loaded two-core machine: not a failure.
           "RINGWRIGHT_COLLECTIVE_TIMEOUT_SECONDS": "600"}
    worker = [sys.executable, str(Path(__file__).with_name("scale_down_worker.py"))]
    with LocalJob(worker, workdir, env=env) as job:
        job.start(3)
        logs = [job.log_path(m.pod) for m in job.world.members]
        deadline = time.monotonic() + 900
        while not all(p.exists() and " world_ready " in p.read_text() for p in logs):
            if time.monotonic() > deadline or any(c not in (None, 0)
                                                  for c in job.exit_codes().values()):
                raise RuntimeError(f"the first world did not form: {job.exit_codes()}")
            time.sleep(0.2)
        job.scale(2)  # published now; every member switches at its next commit
        held.unlink()
        codes = job.wait(900)
    if set(codes.values()) != {0}:
        raise RuntimeError(f"scale-down job failed: exit codes {codes}")
    moved: dict[int, list[int]] = {}
    for log in logs:
        for match in SYNCED.finditer(log.read_text()):
            moved.setdefault(int(match[1]), []).append(int(match[2]))
    if len(moved.get(0, [])) != 3 or len(moved.get(1, [])) != 2:
        raise RuntimeError(f"expected 3 members in generation 0 and 2 in generation 1, got {moved}")
    return moved


def print_checkpoint_table(sizes: list[int], columns: list[dict[str, float]]) -> None:
    """The checkpoint measurements and their ratios, one column per state size."""
    names = list(columns[0])
    width = max(len(n) for n in names) + 2
    print()
    print(f"{'':<{width}}" + "".join(f"{f'{size} MB':>12}" for size in sizes))
    for name in names:
        print(f"{name:<{width}}" + "".join(f"{c[name]:>12.3f}" for c in columns))
    print()
    for size, c in zip(sizes, columns, strict=True):
        stall = c["save() stall"]
        print(
            f"{size} MB: torch.save stalls {c['torch.save'] / stall:.1f}x longer than save()"
            f" ({c['torch.save + fsync'] / stall:.1f}x with fsync,"
            f" {c['torch.save'] / c['save(copy=False) stall']:.0f}x than save(copy=False));"
            f" save() / raw copy = {stall / c['raw copy (clone)']:.2f}"
            f" (first save {c['save() stall, first'] / c['raw copy (clone)']:.2f});"
            f" restore_latest / torch.load ="
            f" {c['restore_latest (cold cache)'] / c['torch.load (cold cache)']:.2f}"
        )
    for size, c in zip(sizes, columns, strict=True):
        slower = c["training slower while writing (%)"]
        print(f"{size} MB: training slowdown while writing {slower:.0f} %"
              f" ({'met' if slower <= 20 else 'MISSED'}: goal <= 20 %); with the writer at"
              f" normal priority {c['training slower while writing, normal priority (%)']:.0f} %")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", default="100,1000",
                        help="state sizes, comma-separated (empty: skip the checkpoint table)")
    parser.add_argument("--scale-down-mb", type=int, default=1000,
                        help="state per worker for the scale-down (0 skips it)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement (median)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes_mb.split(",") if s]

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        print(
            f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch"
            f" threads, load average {os.getloadavg()[0]:.1f}, writing to {tmp};"
            f" median of {args.repeats} runs; seconds unless noted", flush=True)
        if args.scale_down_mb:
            # First, while memory is free: three workers hold the state at once.
            moved = measure_scale_down(args.scale_down_mb, Path(tmp))
            full, down = max(moved[0]), sum(moved[1])
            print(f"scale-down 3 -> 2 of a {args.scale_down_mb} MB state: {down} bytes moved"
                  f" ({'met' if down == 0 else 'MISSED'}: goal 0); a full sync of the same"
                  f" state (the fresh start, same run) moved {full / 1e9:.3f} GB", flush=True)
        columns = [measure(size, args.repeats, Path(tmp)) for size in sizes]
    if columns:
        print_checkpoint_table(sizes, columns)
    rates = checksum_rates()
    print("checksum throughput: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in rates.items()))
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
