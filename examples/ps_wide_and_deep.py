"""Wide-and-deep click-through model trained on parameter servers (synthetic clicks).

The same script runs in every pod of a ``mode: ParameterServer`` TrainingJob: PS pods
(``RINGWRIGHT_ROLE=ps``) serve the shards, workers train. Locally, tests/ps starts it
with a world file. The data is generated from a seed, identically in every process:
categorical fields (user, item, ...) with Zipf-like ids, a few dense features, and
clicks drawn from a hidden logistic model.

Consistency (sync or async, staleness τ, backup workers, re-queueing stale samples)
is not set here: it is the job's ``spec.ps``, which the operator passes as
``RINGWRIGHT_PS_*`` variables (see docs/parameter-server.md). Locally:

    RINGWRIGHT_PS_CONSISTENCY=Async RINGWRIGHT_PS_STALENESS=4 \
        python examples/ps_wide_and_deep.py --samples 20000 --epochs 2
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from typing import TypedDict

import torch
from torch import nn

from ringwright.runtime import ps

FIELDS = 6
DENSE = 4


class Batch(TypedDict):
    ids: torch.Tensor
    """samples x FIELDS categorical ids, already offset into one shared id space."""
    dense: torch.Tensor
    label: torch.Tensor


class WideAndDeep(nn.Module):
    """Wide: a learned weight per id, summed. Deep: embeddings of every field and the
    dense features through an MLP."""

    def __init__(self, vocab: int, dim: int = 16, hidden: int = 64,
                 tables_on: str | None = None) -> None:
        """``tables_on="meta"``: the tables hold no memory here; the parameter servers
        create their rows as training first uses them."""
        super().__init__()
        self.wide = nn.EmbeddingBag(vocab, 1, mode="sum", device=tables_on)
        self.deep = nn.Embedding(vocab, dim, device=tables_on)
        self.mlp = nn.Sequential(nn.Linear(FIELDS * dim + DENSE, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 1))

    def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        wide = self.wide(ids).squeeze(1)
        deep = self.mlp(torch.cat([self.deep(ids).flatten(1), dense], dim=1)).squeeze(1)
        return wide + deep


def synthetic_clicks(samples: int, vocab_per_field: int, seed: int = 7, draw: int = 0) -> Batch:
    """Clicks from a hidden logistic model over Zipf-like ids and dense features.

    The hidden model comes from ``seed`` alone and the samples from ``(seed, draw)``:
    draw 1 is held-out data for a model trained on draw 0, whatever their sizes."""
    g = torch.Generator().manual_seed(seed)
    hidden_wide = torch.randn(FIELDS * vocab_per_field, generator=g)
    hidden_dense = torch.randn(DENSE, generator=g)
    g = torch.Generator().manual_seed(seed * 1_000 + draw + 1)
    ranks = torch.arange(1, vocab_per_field + 1, dtype=torch.float64)
    zipf = (1.0 / ranks) / (1.0 / ranks).sum()
    ids = torch.multinomial(zipf, samples * FIELDS, replacement=True, generator=g)
    ids = ids.view(samples, FIELDS) + torch.arange(FIELDS) * vocab_per_field
    dense = torch.randn(samples, DENSE, generator=g)
    logits = hidden_wide[ids].sum(1) * 0.5 + dense @ hidden_dense
    label = (torch.rand(samples, generator=g) < torch.sigmoid(logits)).float()
    return {"ids": ids, "dense": dense, "label": label}


def holdout_metrics(model: nn.Module, batch: Batch) -> dict[str, float]:
    """Log loss and AUC of ``model`` on ``batch`` (held-out clicks)."""
    with torch.no_grad():
        logits = model(batch["ids"], batch["dense"])
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch["label"])
    return {"loss": float(loss), "auc": auc(logits, batch["label"])}


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve: the chance that a random click scores above a random
    non-click (Mann-Whitney, from the ranks of the scores)."""
    ranks = torch.empty(len(scores), dtype=torch.float64)
    ranks[scores.argsort()] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    clicks = labels.bool()
    n_pos = int(clicks.sum())
    n_neg = len(labels) - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUC needs both clicks and non-clicks in the held-out batch")
    return float((ranks[clicks].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


class Straggler:
    """Makes every step ``factor`` times as long as this worker's own work per step
    (pulls, compute, pushes, ``--slow``): a worker ``factor`` times slower."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.work: list[float] = []
        self.since = time.perf_counter()

    def delay(self) -> None:
        now = time.perf_counter()
        self.work = [*self.work[-15:], now - self.since]
        # The median of recent steps: one slow step does not snowball.
        time.sleep((self.factor - 1) * statistics.median(self.work))
        self.since = time.perf_counter()


def build(args: argparse.Namespace) -> ps.PSJob[Batch]:
    """The model, the data and how to train it: what every pod of the job agrees on."""
    torch.manual_seed(args.seed)
    model = WideAndDeep(FIELDS * args.vocab, args.dim,
                        tables_on="meta" if args.server_tables else None)
    data = synthetic_clicks(args.samples, args.vocab, args.seed)
    bce = nn.BCEWithLogitsLoss()
    slow = args.slow if args.slow > 0 else 0.0
    straggler = Straggler(args.slow_factor) if args.slow_factor > 1 else None

    def fetch(index: torch.Tensor) -> Batch:
        return {"ids": data["ids"][index], "dense": data["dense"][index],
                "label": data["label"][index]}

    def loss(m: nn.Module, b: Batch) -> torch.Tensor:
        if slow:
            time.sleep(slow)  # benchmarks: extra work per batch
        if straggler is not None:
            straggler.delay()
        logits: torch.Tensor = m(b["ids"], b["dense"])
        return bce(logits, b["label"])

    return ps.PSJob(
        model, loss=loss, fetch=fetch, samples=args.samples, batch_size=args.batch_size,
        epochs=args.epochs, piece_batches=args.piece_batches,
        ids=lambda b: {"wide.weight": b["ids"], "deep.weight": b["ids"]},
        optimizer=ps.ServerOptimizer(ps.OptimizerKind(args.optimizer), lr=args.lr),
        final_state=bool(args.final))


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=20_000)
    p.add_argument("--vocab", type=int, default=5_000, help="ids per categorical field")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--server-tables", action="store_true",
                   help="the servers create the tables' rows on first use (no process holds "
                   "a whole table: for tables of tens of millions of rows)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--piece-batches", type=int, default=8)
    p.add_argument("--optimizer", default="adagrad", choices=["sgd", "adagrad", "adam"])
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slow", type=float, default=0.0, help="seconds of extra work per batch")
    p.add_argument("--slow-factor", type=float, default=1.0,
                   help="make each step this many times as long as the worker's own work")
    p.add_argument("--trace", default="", help="append one JSON line per step here")
    p.add_argument("--final", default="", help="save every parameter here at the end")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse(argv)
    job = build(args)
    if args.trace:
        trace = open(args.trace, "a", buffering=1)  # noqa: SIM115 (open for the whole run)

        def on_step(info: ps.StepInfo) -> None:
            trace.write(json.dumps({"t": time.time(), **info.__dict__}) + "\n")

        job.on_step = on_step
    report = ps.run(job)
    if report is not None:
        if args.final:
            torch.save(report.final, args.final)
        print(json.dumps({"steps": report.steps, "samples": report.samples,
                          "dropped": report.dropped_pushes, "trained": report.trained_samples,
                          "droppedSamples": report.dropped_samples, "lost": report.lost_updates,
                          "left": report.left}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
