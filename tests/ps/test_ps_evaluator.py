"""An evaluator reads a running PS job's model beside its workers (real processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringwright.runtime.ps import Evaluator
from tests.ps.harness import WAIT_S, LocalPSJob, consistency, load_example

ARGS = ["--samples", "8192", "--vocab", "200", "--dim", "4", "--batch-size", "32",
        "--piece-batches", "4", "--epochs", "1", "--optimizer", "adagrad", "--lr", "0.05",
        "--slow", "0.005"]


def test_an_evaluator_scores_the_servers_model_as_the_workers_train_it(
        tmp_path: Path) -> None:
    example = load_example()
    args = example.parse(ARGS)
    holdout = example.synthetic_clicks(2048, args.vocab, args.seed, draw=1)
    untrained = example.holdout_metrics(example.build(args).model, holdout)
    job = LocalPSJob(tmp_path, servers=2, args=ARGS, env=consistency("Async", tau=4))
    # Built without the job's consistency: the evaluator creates no shard, so what it
    # would have configured them with never reaches the servers.
    evaluator = Evaluator(example.build(args), job.addresses())
    try:
        job.publish(["w0", "w1"])
        for p in job.ps:
            job.start(p, "ps")
        evaluator.client.wait_ready(WAIT_S)  # the servers are up, but no worker yet
        with pytest.raises(TimeoutError, match="a worker creates them"):
            evaluator.connect(2.0)
        for w in ("w0", "w1"):
            job.start(w, "worker")
        evaluator.connect(WAIT_S)
        job.wait_steps("w0", 80)
        versions = evaluator.load(holdout)
        later = example.holdout_metrics(evaluator.job.model, holdout)
        codes = job.wait_all()
    finally:
        evaluator.close()
        job.close()
    assert all(c == 0 for c in codes.values()), job.logs()
    # The servers applied the workers' pushes, and the model read back learned from them.
    assert min(versions.values()) >= 40
    assert later["loss"] < untrained["loss"] - 0.02, (untrained, later)
    assert later["auc"] > untrained["auc"] + 0.05, (untrained, later)
    # The job ran as without the evaluator: asynchronous within tau, every sample once.
    assert "dropped_staleness=-" in (tmp_path / "ps-0.log").read_text(), job.logs()
    results = [job.result(w) for w in ("w0", "w1")]
    assert sum(r["trained"] for r in results) == 8192
