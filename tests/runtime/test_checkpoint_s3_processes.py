"""A job that checkpoints to a real S3 server, loses every process to SIGKILL, and is
started again: it resumes from the newest checkpoint in the bucket and accounts for every
sample exactly once."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from ringwright.runtime.checkpoint.checkpointer import Checkpointer
from ringwright.runtime.checkpoint.storage import storage_for
from ringwright.runtime.local.launcher import LocalJob
from ringwright.world import CheckpointSettings, LRRule, LRScaling
from tests.runtime.test_state_processes import (
    DEADLINE_S,
    WORKER,
    commit_hash,
    finish,
    gate,
    job_env,
    log_tails,
    traces,
    wait_at_gate,
)
from tests.s3 import S3Bucket

pytestmark = pytest.mark.timeout(900)

EPOCHS, SAMPLES, WORKERS = 2, 192, 2


def new_job(tmp_path: Path, name: str, spec: CheckpointSettings) -> LocalJob:
    workdir = tmp_path / name
    (workdir / "gates").mkdir(parents=True)
    # The AWS_* variables of the s3_bucket fixture reach the workers with the environment.
    return LocalJob([sys.executable, str(WORKER)], workdir,
                    env=job_env(workdir, EPOCHS=str(EPOCHS), SAMPLES=str(SAMPLES)),
                    lr=LRScaling(rule=LRRule.LINEAR, base_world_size=4), checkpoint=spec)


def test_a_killed_job_resumes_from_the_bucket_with_exact_accounting(
        s3_bucket: S3Bucket, tmp_path: Path) -> None:
    spec = CheckpointSettings(path=s3_bucket.url("jobs/demo"), intervalSteps=4, keep=2)
    first = new_job(tmp_path, "first", spec)
    try:
        held = gate(first, 10)
        first.start(WORKERS)
        wait_at_gate(first, 10, WORKERS)
        # The checkpoint of step 8's commit is written in the background: wait for it.
        deadline = time.monotonic() + DEADLINE_S
        while 8 not in Checkpointer(storage_for(spec.path)).steps():
            assert time.monotonic() < deadline, f"no checkpoint of step 8\n{log_tails(first)}"
            time.sleep(0.1)
        for member in first.world.members:
            first.kill(member.pod, signal.SIGKILL)
        for member in first.world.members:
            first.pod(member.pod).process.wait()
        held.unlink()
    finally:
        first.close()
    assert Checkpointer(storage_for(spec.path)).steps() == [4, 8], "keep: 2"
    assert [k for k in s3_bucket.keys("jobs/demo/") if k.endswith(".manifest.json")] == [
        "jobs/demo/model/step-000000000004.manifest.json",
        "jobs/demo/model/step-000000000008.manifest.json",
    ]

    second = new_job(tmp_path, "second", spec)
    try:
        second.start(WORKERS)
        finish(second)
    finally:
        second.close()
    starts = traces(second).starts(0)
    assert {r["step"] for r in starts.values()} == {8}, "resumed from the newest checkpoint"
    assert {r["hash"] for r in starts.values()} == {commit_hash(first, 8)}
    batch = int(job_env(tmp_path)["BATCH"])
    assert {r["seen"] for r in starts.values()} == {8 * batch * WORKERS}
    done = [r for _, r in traces(second).events("done")]
    assert len(done) == WORKERS
    # Every sample of both epochs counted once: none lost to the kill, none trained twice.
    assert {r["seen"] for r in done} == {EPOCHS * SAMPLES}
    assert {r["step"] for r in done} == {EPOCHS * SAMPLES // (batch * WORKERS)}
    assert len({r["hash"] for r in done}) == 1
