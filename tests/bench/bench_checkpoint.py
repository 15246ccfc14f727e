"""Benchmark: how long a checkpoint stalls training, against the obvious alternatives.

For a training state of each size (model weights plus Adam's two moments, as many
tensors as a real model has) it measures, in one run on one machine:

* raw copy: cloning every tensor into fresh memory, the least a snapshot could cost
  without reusing buffers;
* save() stall: the time ``Checkpointer.save`` blocks the training loop, for the first
  save (buffer allocated) and later ones (buffer reused);
* background write: from save() returning to the checkpoint being durable on disk;
* slowdown: how much slower a CPU training step runs while that write is in flight;
* torch.save: a synchronous save of the same state, the stall without this module
  (with and without the fsync that makes it durable);
* restore: ``restore_latest`` (read, verify, rebuild) against ``torch.load``, both with
  the files evicted from the page cache, as after a pod restart.

Run: ``python tests/bench/bench_checkpoint.py`` (``--sizes-mb 100,1000 --repeats 3``).
Needs about 4x the largest size in memory and 3x on disk under ``--dir``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import os
import shutil
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ringwright.runtime.checkpoint import Checkpointer, LocalStorage

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


def step_time(work: torch.Tensor, until: Callable[[], bool] | None = None) -> float:
    """Mean time of a CPU training-like step (a matmul), run until ``until`` says stop."""
    steps, started = 0, time.perf_counter()
    while True:
        torch.mm(work, work)
        steps += 1
        if (until is None and steps == 50) or (until is not None and until()):
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

    # The write runs beside training: how much slower does a CPU step get meanwhile?
    work = torch.randn(384, 384)
    slowdowns = []
    for step in range(repeats):
        idle = step_time(work)
        ckpt.save(step, state)
        slowdowns.append(step_time(work, until=lambda: ckpt.flush(timeout=0)) / idle - 1)
    result["CPU step slower during write (%)"] = 100 * statistics.median(slowdowns)
    ckpt.close()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", default="100,1000", help="state sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement (median)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes_mb.split(",")]

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        print(
            f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch"
            f" threads, load average {os.getloadavg()[0]:.1f}, writing to {tmp};"
            f" median of {args.repeats} runs; seconds unless noted"
        )
        columns = [measure(size, args.repeats, Path(tmp)) for size in sizes]

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
    rates = checksum_rates()
    print("checksum throughput: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in rates.items()))
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
