"""An evaluator reads a running PS job's model beside its workers (real processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringwright.runtime.ps import Evaluator
from tests.ps.harness import WAIT_S, LocalPSJob, consistency, load_example, ps_done

ARGS = ["--samples", "8192", "--vocab", "200", "--dim", "4", "--batch-size", "32",
        "--piece-batches", "4", "--epochs", "1", "--optimizer", "adagrad", "--lr", "0.05",
        "--slow", "0.005"]
TAU = 4


def test_an_evaluator_scores_the_servers_model_as_the_workers_train_it(
        tmp_path: Path) -> None:
    example = load_example()
    args = example.parse(ARGS)
    holdout = example.synthetic_clicks(2048, args.vocab, args.seed, draw=1)
    untrained = example.holdout_metrics(example.build(args).model, holdout)
    # Stale pushes re-queue their samples: a worker held back by a loaded machine can push
    # beyond tau, and the job must still train every sample once.
    job = LocalPSJob(tmp_path, servers=2, args=ARGS,
                     env=consistency("Async", tau=TAU, requeue_stale=True))
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
    # The job ran as without the evaluator: every push a server counted (applied or dropped
    # as stale) came from a worker's step, those shard 0 (on ps-0, the judge) applied
    # within tau, and every sample trained once.
    results = [job.result(w) for w in ("w0", "w1")]
    worker_steps = sum(r["steps"] for r in results)
    for p in job.ps:
        counts = ps_done((tmp_path / f"{p}.log").read_text())
        applied, dropped = counts["staleness"], counts["dropped_staleness"]
        assert sum(applied.values()) + sum(dropped.values()) == worker_steps, job.logs()
        if p == "ps-0":
            assert max(applied) <= TAU < min(dropped, default=TAU + 1), job.logs()
    assert sum(r["trained"] for r in results) == 8192
