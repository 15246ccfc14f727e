"""A member killed in the middle of a hierarchical all-reduce: the survivors recover as
they do from a broken flat ring, and the next world (uneven racks now) is hierarchical too.

Real worker processes (``elastic_worker.py``) on loopback, in two racks, with
``hierarchicalAllReduce: Auto``; once with the all-reduce after backward, once with
bucketed overlap. The victim is frozen first, so its peers are certainly waiting
inside the step's all-reduce when it is killed.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ringwright.runtime.local.launcher import LocalJob
from ringwright.world import Env, HierarchicalAllReduce, TopologySettings
from tests.runtime.elastic_traces import (
    Traces,
    assert_every_sample_once,
    assert_params_identical,
    assert_resumed_from_commit,
)

WORKER = Path(__file__).with_name("elastic_worker.py")
SAMPLES = 160
EPOCHS = 2
DEADLINE_S = 240.0

pytestmark = pytest.mark.timeout(420)


@pytest.fixture(params=["after-backward", "buckets"])
def job(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LocalJob]:
    env = {
        Env.BACKEND: "torch",
        "TRACE_DIR": str(tmp_path / "trace"),
        "EPOCHS": str(EPOCHS),
        "SAMPLES": str(SAMPLES),
        "BATCH": "4",
        "COMMIT_EVERY": "4",
        "STEP_SLEEP": "0.03",
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        "OMP_NUM_THREADS": "1",
    }
    if request.param == "buckets":
        env["BUCKET_BYTES"] = "256"  # several buckets even for the tiny model
    topology = TopologySettings(hierarchical_all_reduce=HierarchicalAllReduce.AUTO)
    with LocalJob([sys.executable, str(WORKER)], tmp_path, env=env,
                  racks=("rack-a", "rack-a", "rack-b", "rack-b"),
                  topology=topology) as local_job:
        yield local_job


def wait_for(what: str, probe: object, job: LocalJob) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not probe():  # type: ignore[operator]
        if time.monotonic() > deadline:
            tails = "\n".join(job.log_path(p).read_text()[-1500:] for p in job.exit_codes())
            raise AssertionError(f"timed out waiting for {what}\n{tails}")
        time.sleep(0.05)


def last_step(job: LocalJob, pod: str) -> int:
    records = Traces.load(job.workdir / "trace").by_pod.get(pod, [])
    return max((r["step"] for r in records if r["ev"] == "step"), default=0)


def in_allreduce(job: LocalJob, pod: str, step: int) -> bool:
    """``pod`` has begun a step at or after ``step`` and not finished it: it traces a
    step right before the all-reduce and ``stepped`` right after."""
    records = Traces.load(job.workdir / "trace").by_pod.get(pod, [])
    return bool(records) and records[-1]["ev"] == "step" and records[-1]["step"] >= step


def test_kill_inside_a_hierarchical_step_recovers_like_the_flat_ring(job: LocalJob) -> None:
    job.start(4)
    wait_for("training to reach step 6", lambda: Traces.load(job.workdir / "trace")
             .max_step() >= 6, job)
    victim = job.world.members[2].pod  # rack-b: its rack keeps one member
    job.kill(victim, signal.SIGSTOP)
    frozen_at = last_step(job, victim)
    others = [m.pod for m in job.world.members if m.pod != victim]
    # Every peer is in a step's all-reduce, which cannot end without the victim.
    wait_for("the peers to block in the all-reduce",
             lambda: all(in_allreduce(job, p, frozen_at) for p in others), job)
    job.kill(victim, signal.SIGKILL)
    codes = job.wait(DEADLINE_S)

    assert codes[victim] == -signal.SIGKILL
    assert all(codes[p] == 0 for p in others), codes
    assert job.world.size == 3 and [m.rack for m in job.world.members] == [
        "rack-a", "rack-a", "rack-b"]
    for pod in others:
        log = job.log_path(pod).read_text()
        assert "hierarchical=True" in log and "rolled_back" in log, log[-2000:]
    t = Traces.load(job.workdir / "trace")
    assert_every_sample_once(t, SAMPLES, EPOCHS)
    assert_params_identical(t)
    assert_resumed_from_commit(t, before=0, after=1)
