"""Every sample of an epoch, counted apart: trained, dropped as stale, re-queued.

Real PS and worker processes; a fast worker and a slow one with a small staleness bound,
so that the slow one's pushes are dropped. The servers' counts (the data-shard
service's final log line) and the workers' own traces (one line per step, with its
sample range) must agree, sample by sample:

* re-queue off: every sample is trained once or dropped once, and each drop is one
  the staleness bound asked for;
* re-queue on: every sample is trained exactly once, its drops re-queued and counted;
* two servers: both apply (and drop) the same steps, since shard 0 judges each step and
  the other shards follow its verdict.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from tests.ps.harness import LocalPSJob, consistency, ps_done

SAMPLES = 2048
BATCH = 32
TAU = 2
ARGS = ["--samples", str(SAMPLES), "--vocab", "300", "--dim", "4", "--batch-size", str(BATCH),
        "--piece-batches", "4", "--epochs", "1", "--optimizer", "adagrad"]
WORKERS = ("fast", "slow")


def _run(tmp_path: Path, requeue: bool) -> tuple[LocalPSJob, dict[str, dict[int, int]]]:
    job = LocalPSJob(tmp_path, 1, ARGS, consistency("Async", tau=TAU, requeue_stale=requeue))
    try:
        # The slow worker is held (SIGSTOP) after its first step until the fast one has
        # pushed more than τ times, so its next push is stale whatever either's start-up
        # costs. Started together, either could train the whole epoch while the other
        # still imports torch (seen both ways on a loaded machine), and nothing is dropped.
        job.publish(list(WORKERS))
        for p in job.ps:
            job.start(p, "ps")
        job.start("slow", "worker", ["--slow", "0.05"])
        job.wait_steps("slow", 1)
        job.procs["slow"].send_signal(signal.SIGSTOP)
        try:
            job.start("fast", "worker")
            job.wait_steps("fast", TAU + 2)
        finally:
            job.procs["slow"].send_signal(signal.SIGCONT)
        codes = job.wait_all()
        assert all(c == 0 for c in codes.values()), job.logs()
        return job, ps_done((job.root / "ps-0.log").read_text())
    finally:
        job.close()


def _steps(job: LocalPSJob) -> list[dict[str, Any]]:
    return [s for w in WORKERS for s in job.steps(w)]


def _times_covered(steps: list[dict[str, Any]]) -> list[int]:
    """How many of ``steps`` cover each sample of the epoch."""
    covered = [0] * SAMPLES
    for s in steps:
        assert s["stop"] - s["start"] == s["samples"], s
        for i in range(s["start"], s["stop"]):
            covered[i] += 1
    return covered


def _justified(steps: list[dict[str, Any]]) -> None:
    """Pushes were dropped because, and only because, they were staler than the bound."""
    assert all(s["staleness"] > TAU for s in steps if s["dropped"]), steps
    assert all(s["staleness"] <= TAU for s in steps if not s["dropped"]), steps


def test_requeue_off_every_sample_is_trained_once_or_dropped_and_counted(
        tmp_path: Path) -> None:
    job, counts = _run(tmp_path, requeue=False)
    steps = _steps(job)
    trained = [s for s in steps if not s["dropped"]]
    dropped = [s for s in steps if s["dropped"]]
    assert dropped, "the slow worker's pushes must be dropped for this test to mean anything"
    # By the workers' traces: each sample in exactly one step, trained or dropped.
    assert _times_covered(steps) == [1] * SAMPLES
    _justified(steps)
    # By the servers' count, apart, and the same as the workers'.
    assert counts["trained"].get(0, 0) == sum(s["samples"] for s in trained), counts
    assert counts["dropped"].get(0, 0) == sum(s["samples"] for s in dropped), counts
    assert counts["trained"][0] + counts["dropped"][0] == SAMPLES
    assert sum(counts["requeued_stale"].values()) == 0, counts
    for w in WORKERS:
        result = job.result(w)
        assert result["trained"] + result["droppedSamples"] == result["samples"], result
    assert sum(job.result(w)["trained"] for w in WORKERS) == counts["trained"][0]


def test_requeue_on_every_sample_is_trained_exactly_once(tmp_path: Path) -> None:
    job, counts = _run(tmp_path, requeue=True)
    steps = _steps(job)
    trained = [s for s in steps if not s["dropped"]]
    dropped = [s for s in steps if s["dropped"]]
    assert dropped, "the slow worker's pushes must be dropped for this test to mean anything"
    # By the workers' traces: each sample trained in exactly one step.
    assert _times_covered(trained) == [1] * SAMPLES
    _justified(steps)
    # By the servers' count: all trained; every drop re-queued, and counted.
    assert counts["trained"][0] == SAMPLES, counts
    assert counts["dropped"][0] == sum(s["samples"] for s in dropped), counts
    assert counts["requeued_stale"][0] == counts["dropped"][0], counts
    assert sum(job.result(w)["trained"] for w in WORKERS) == SAMPLES



def test_two_servers_apply_and_drop_the_same_steps(tmp_path: Path) -> None:
    # Two workers pushing side by side with τ = 1: many pushes are borderline, stale on one
    # shard's clock and not on the other's, had each shard judged them alone.
    job = LocalPSJob(tmp_path, 2, [*ARGS, "--slow", "0.005"],
                     consistency("Async", tau=1, requeue_stale=True))
    try:
        job.publish(list(WORKERS))
        job.start_all(list(WORKERS))
        codes = job.wait_all()
        assert all(c == 0 for c in codes.values()), job.logs()
    finally:
        job.close()
    steps = _steps(job)
    trained = [s for s in steps if not s["dropped"]]
    dropped = [s for s in steps if s["dropped"]]
    assert dropped, "pushes must be dropped for this test to mean anything"
    assert _times_covered(trained) == [1] * SAMPLES
    # Each server applied exactly the steps the workers count as trained and dropped the
    # rest: no step updated one shard and not the other.
    for p in job.ps:
        server = ps_done((job.root / f"{p}.log").read_text())
        assert sum(server["staleness"].values()) == len(trained), (p, server, job.logs())
        assert sum(server["dropped_staleness"].values()) == len(dropped), (p, server)
    assert sum(job.result(w)["trained"] for w in WORKERS) == SAMPLES
