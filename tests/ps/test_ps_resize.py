"""Servers that grow and shrink under training: 2 -> 3 -> 2, on real processes.

The job has three shards for its life (``RINGWRIGHT_PS_SHARDS``), so two servers hold
shards 0 and 2 on ps-0 and shard 1 on ps-1. Growing to three moves shard 2 to the new
ps-2; shrinking back moves it home to ps-0 before ps-2 exits. Meanwhile two workers
train, and the test checks:

* every sample of every epoch is trained exactly once (re-queue of stale drops on), by
  the data-shard service's count and by the workers' own traces, trained, dropped and
  re-queued counted apart;
* no update is lost: each shard's final version is the number of steps the workers
  count as applied (every applied step updates every shard once), whichever servers
  the shard was on meanwhile;
* the workers trained after each move (they kept training through it).

The pause each move caused is printed, never asserted (a wall-clock figure on a shared
machine): how long the shard was served by nobody (the server's ``held_s``) and how much
longer than the median step the workers' step around the move took.
"""

from __future__ import annotations

from pathlib import Path

from ringwright.runtime.ps.env import PSEnv
from tests.ps.harness import LocalPSJob, consistency, moved, ps_done, step_overrun

SAMPLES = 3072
EPOCHS = 4
BATCH = 32
ARGS = ["--samples", str(SAMPLES), "--vocab", "300", "--dim", "4", "--batch-size", str(BATCH),
        "--piece-batches", "4", "--epochs", str(EPOCHS), "--optimizer", "adagrad",
        "--slow", "0.03"]
WORKERS = ("w0", "w1")
SHARDS = 3
MOVE_WAIT_S = 120.0
"""How long a move may take once asked for: every process is up by then, and a move
takes milliseconds (a move that never comes fails the test here, not at the harness's
start-up allowance)."""


def test_servers_grow_2_to_3_and_shrink_back_with_exact_accounting(tmp_path: Path) -> None:
    env = {**consistency("Async", tau=16, requeue_stale=True), PSEnv.SHARDS: str(SHARDS)}
    job = LocalPSJob(tmp_path, 2, ARGS, env)
    try:
        # ps-2's process starts with the others and waits for a world that lists it, as
        # a pod that is up before the operator lists it (importing torch is not a move).
        job.start_server(2)
        job.start_all(list(WORKERS))
        job.wait_steps("w0", 10)
        job.resize(3)
        grown = moved(job.wait_log("ps-0", "ps_moved shard=2 to=2", MOVE_WAIT_S))
        trained_on_three = len(job.steps("w0"))
        job.wait_steps("w0", trained_on_three + 10)
        job.resize(2)
        shrunk = moved(job.wait_log("ps-2", "ps_moved shard=2 to=0", MOVE_WAIT_S))
        codes = job.wait_all()
        assert all(c == 0 for c in codes.values()), job.logs()
        assert "ps_left_world" in (job.root / "ps-2.log").read_text(), job.logs()
    finally:
        job.close()
    steps = {w: job.steps(w) for w in WORKERS}
    traced = [s for w in WORKERS for s in steps[w]]
    # Training went on after each move.
    for move in (grown, shrunk):
        assert any(s["t"] > move["at"] for s in traced), (move, job.logs())

    # Every sample of every epoch trained exactly once; drops counted and re-queued.
    counts = ps_done((job.root / "ps-0.log").read_text())
    for epoch in range(EPOCHS):
        mine = [s for s in traced if s["epoch"] == epoch]
        covered = [0] * SAMPLES
        for s in mine:
            if not s["dropped"]:
                for i in range(s["start"], s["stop"]):
                    covered[i] += 1
        assert covered == [1] * SAMPLES, (epoch, job.logs())
        assert counts["trained"][epoch] == SAMPLES, counts
        dropped = sum(s["samples"] for s in mine if s["dropped"])
        assert counts["dropped"].get(epoch, 0) == dropped, counts
        assert counts["requeued_stale"].get(epoch, 0) == dropped, counts

    # No update lost: every shard, wherever it ended, applied every step the workers
    # count as applied, once.
    versions: dict[int, int] = {}
    for pod in ("ps-0", "ps-1"):
        versions.update(ps_done((job.root / f"{pod}.log").read_text())["versions"])
    applied = sum(1 for s in traced if not s["dropped"])
    assert versions == dict.fromkeys(range(SHARDS), applied), (versions, applied)

    for name, move in (("2 -> 3", grown), ("3 -> 2", shrunk)):
        overrun = max(step_overrun(steps[w], move["at"]) for w in WORKERS)
        print(f"resize {name}: shard {int(move['shard'])} to ps-{int(move['to'])} at version "
              f"{int(move['version'])}: served by nobody {move['held_s'] * 1000:.1f} ms, "
              f"the workers' step around it {overrun * 1000:.1f} ms over the median step")
