"""Accuracy per wall-clock minute of the PS consistency modes (part of bench_ps.py).

Throughput alone flatters async training: a push computed from parameters several
versions old moves the model less well than a fresh one, and one dropped as too stale
moves it not at all. So each mode trains the wide-and-deep example (2 servers, 4
workers, one of them 3x slower) for the same wall-clock time while an evaluator beside
the workers (``ringwright.runtime.ps.Evaluator``, no member of any sync round) pulls the
model about once a second and scores it on held-out clicks from the same hidden model.
Printed: the held-out log loss and AUC reached at each mark, samples trained, pushes
dropped as stale; drawn: loss against time, one line per mode (PNG).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from ringwright.runtime.ps.evaluator import Evaluator
from tests.ps.harness import WAIT_S, LocalPSJob, consistency, load_example

MODES: list[tuple[str, dict[str, str]]] = [
    ("sync", consistency("Sync")),
    ("sync, 1 backup", consistency("Sync", backup_workers=1)),
    ("async tau=2", consistency("Async", tau=2)),
    ("async tau=8", consistency("Async", tau=8)),
    ("async tau=32", consistency("Async", tau=32)),
]
ARGS = ["--samples", "262144", "--vocab", "5000", "--dim", "16", "--batch-size", "64",
        "--piece-batches", "4", "--epochs", "20", "--optimizer", "adagrad", "--lr", "0.005",
        "--slow", "0.02"]
"""More data than any mode trains in the time given (every mode is stopped by the clock,
never by the end of its data), and a learning rate low enough that no mode has
converged within seconds: the modes differ by how far a minute takes them."""
HOLDOUT = 8192
WORKERS = ["w0", "w1", "w2", "w3"]


@dataclasses.dataclass
class Curve:
    """One mode's held-out scores over time."""

    mode: str
    points: list[tuple[float, float, float]] = dataclasses.field(default_factory=list)
    """(seconds since the first step, log loss, AUC)."""
    trained: int = 0
    dropped_pushes: int = 0
    pushes: int = 0

    def reached(self, loss: float) -> float:
        """Seconds until the first evaluation at or below ``loss``."""
        return next(p[0] for p in self.points if p[1] <= loss)

    def at(self, seconds: float) -> tuple[float, float]:
        """Loss and AUC of the last evaluation at or before ``seconds``."""
        before = [p for p in self.points if p[0] <= seconds]
        if not before:
            raise RuntimeError(f"{self.mode}: no evaluation within {seconds:.0f} s")
        return before[-1][1], before[-1][2]


def run_mode(root: Path, mode: str, env: dict[str, str], seconds: float) -> Curve:
    """Train ``mode`` for ``seconds`` from its first step, scoring the model as it goes."""
    example = load_example()
    args = example.parse(ARGS)
    holdout = example.synthetic_clicks(HOLDOUT, args.vocab, args.seed, draw=1)
    folder = root / mode.replace(" ", "_").replace(",", "").replace("=", "")
    folder.mkdir()
    job = LocalPSJob(folder, 2, ARGS, env)
    curve = Curve(mode)
    evaluator: Evaluator[Any] = Evaluator(example.build(args), job.addresses())
    try:
        job.start_all(WORKERS, extra={"w3": ["--slow-factor", "3"]})
        evaluator.connect(WAIT_S)
        job.wait_steps("w0", 1)
        start = min(s["t"] for w in WORKERS for s in job.steps(w))
        while (now := time.time()) - start <= seconds:
            evaluator.load(holdout)
            scores = example.holdout_metrics(evaluator.job.model, holdout)
            curve.points.append((now - start, scores["loss"], scores["auc"]))
            job.check_alive()
            time.sleep(max(0.0, 1.0 - (time.time() - now)))
        steps = [s for w in WORKERS for s in job.steps(w) if s["t"] - start <= seconds]
        curve.trained = sum(s["samples"] for s in steps if not s["dropped"])
        curve.dropped_pushes = sum(1 for s in steps if s["dropped"])
        curve.pushes = len(steps)
    finally:
        evaluator.close()
        job.close()
    return curve


def bench_accuracy(root: Path, seconds: float, plot: Path) -> list[Curve]:
    """Every mode for ``seconds``; prints the table, draws ``plot``."""
    curves = [run_mode(root, mode, env, seconds) for mode, env in MODES]
    marks = [seconds * f for f in (1 / 12, 1 / 6, 1 / 3, 2 / 3, 1.0)]
    print(f"held-out log loss (AUC) of {HOLDOUT:,} clicks, by seconds of training; "
          f"2 servers, 4 workers, w3 3x slower")
    print(f"{'mode':>16}" + "".join(f"{m:>16.0f}" for m in marks)
          + f"{'trained':>10}{'dropped':>9}")
    for c in curves:
        cells = "".join(f"{loss:>9.4f} ({auc:.3f})" for loss, auc in map(c.at, marks))
        drop = c.dropped_pushes / c.pushes if c.pushes else 0.0
        print(f"{c.mode:>16}{cells}{c.trained:>10}{drop:>9.1%}")
    # The loss every mode reached: how long each took to get there, against sync.
    target = max(c.at(seconds)[0] for c in curves)
    reached = {c.mode: c.reached(target) for c in curves}
    print(f"seconds to reach a held-out loss of {target:.4f} (the worst mode's at "
          f"{seconds:.0f} s): " + "; ".join(
              f"{mode} {t:.1f} ({reached['sync'] / t:.1f}x sync)" for mode, t in reached.items()))
    print(f"(the untrained model: about {max(c.points[0][1] for c in curves):.4f})")
    draw(curves, plot)
    print(f"plot: {plot}")
    return curves


def draw(curves: list[Curve], path: Path) -> None:
    """Held-out loss against seconds of training, one line per mode."""
    fig = Figure(figsize=(7.5, 4.2), dpi=110)
    ax = fig.add_subplot()
    for c in curves:
        ax.plot([p[0] for p in c.points], [p[1] for p in c.points], label=c.mode)
    ax.set_xlabel("seconds of training (wall clock)")
    ax.set_ylabel("held-out log loss")
    ax.set_title("Wide-and-deep on 2 PS, 4 workers (one 3x slower)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
