"""Pods of three local ranks each (the pod entry point, gloo on loopback) while a
local rank dies, a pod dies, and the job grows from two pods to three.

The same audit as the one-process-per-pod tests: every sample of every data epoch
trained exactly once counting from the commits, parameters identical on every rank.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ringwright.runtime.local.launcher import LocalJob
from ringwright.world import CheckpointSettings
from tests.runtime.elastic_traces import (
    Traces,
    assert_every_sample_once,
    assert_params_identical,
    assert_resumed_from_commit,
)
from tests.runtime.pod_ranks import pod_ranks
from tests.runtime.test_elastic_processes import (
    BOTH_BACKENDS,
    EPOCHS,
    GATE_STEP,
    SAMPLES,
    WORKER,
    assert_no_rollback,
    audit,
    finish,
    hold_at_gate,
    hold_late,
    wait_for_step,
    wait_until,
    worker_env,
)

LOCAL = 3

pytestmark = pytest.mark.timeout(420)


@pytest.fixture()
def job(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LocalJob]:
    env = worker_env(tmp_path, getattr(request, "param", "torch"))
    with LocalJob([sys.executable, str(WORKER)], tmp_path, env=env,
                  procs_per_pod=LOCAL) as local_job:
        yield local_job


def local_ranks_of(job: LocalJob, pod: str) -> dict[int, int]:
    """The pids of ``pod``'s local ranks, by local rank."""
    return pod_ranks(job.pod(pod).process.pid, job.log_path(pod))


def test_the_world_lists_every_local_rank() -> None:
    # Cheap check of the shape, before the slow process tests.
    from ringwright.world import JobRef, Member, StoreAddress, World

    members = tuple(Member(rank=i, pod=f"p{i // 3}", local_rank=i % 3, ip="127.0.0.1")
                    for i in range(6))
    world = World(job=JobRef(namespace="n", name="j"), generation=0, members=members,
                  store=StoreAddress(address="127.0.0.1"))
    assert world.pods == ("p0", "p1")
    assert world.member("p1", 2) == members[5]


@pytest.mark.parametrize("job", ["torch", pytest.param("horovod", marks=pytest.mark.horovod)],
                         indirect=True)
def test_a_dead_local_rank_takes_its_pod_out_and_the_other_pod_goes_on(
        job: LocalJob) -> None:
    gate = hold_late(job)
    job.start(2)
    assert job.world.size == 2 * LOCAL
    wait_for_step(job, 6)
    victim = job.world.members[LOCAL].pod
    wait_until(job, "the victim's local ranks", lambda: len(local_ranks_of(job, victim)) == 3)
    os.kill(local_ranks_of(job, victim)[1], signal.SIGKILL)
    gate.unlink()
    codes = finish(job)

    # The entry point stopped the pod's other ranks and exited as its rank did.
    assert codes[victim] == 128 + signal.SIGKILL
    assert job.world.pods == (job.world.members[0].pod,)
    assert job.world.size == LOCAL and job.world.generation == 1
    t = audit(job)
    assert {r["size"] for r in t.starts(1).values()} == {LOCAL}
    assert_resumed_from_commit(t, before=0, after=1)


def test_a_killed_pod_loses_all_its_ranks_at_once(job: LocalJob) -> None:
    gate = hold_late(job)
    job.start(2)
    wait_for_step(job, 6)
    victim = job.world.members[0].pod  # also hosts the store (rank 0)
    job.kill(victim, signal.SIGKILL)
    gate.unlink()
    finish(job)

    assert job.world.size == LOCAL and job.world.generation == 1
    assert victim not in job.world.pods
    t = audit(job)
    assert_resumed_from_commit(t, before=0, after=1)


@BOTH_BACKENDS
def test_scale_two_pods_to_three(job: LocalJob) -> None:
    gate = hold_at_gate(job)
    job.start(2)
    wait_for_step(job, GATE_STEP)
    job.scale(3)
    wait_until(job, "the third pod to be ready and added", lambda: len(job.world.pods) == 3)
    gate.unlink()
    finish(job)

    assert job.world.size == 3 * LOCAL
    assert [(m.rank, m.local_rank) for m in job.world.members] == [
        (i, i % LOCAL) for i in range(3 * LOCAL)]
    t = audit(job)
    assert len(set(t.starts(1)) - set(t.starts(0))) == LOCAL
    assert_resumed_from_commit(t, before=0, after=1)
    assert_no_rollback(t)



def test_one_rank_of_the_job_writes_the_checkpoints(tmp_path: Path) -> None:
    env = {"TRACE_DIR": str(tmp_path / "trace"), "EPOCHS": "1", "SAMPLES": str(SAMPLES),
           "BATCH": "4", "COMMIT_EVERY": "2", "STEP_SLEEP": "0.01", "OMP_NUM_THREADS": "1",
           "TORCH_CPP_LOG_LEVEL": "ERROR", "CHECKPOINT_DIR": str(tmp_path / "ckpt")}
    with LocalJob([sys.executable, str(WORKER)], tmp_path, env=env, procs_per_pod=LOCAL,
                  checkpoint=CheckpointSettings(interval_steps=2)) as job:
        job.start(2)
        finish(job)
        t = audit_one_epoch(job)
    writers = {name for name, _ in t.events("checkpoint_written")}
    rank0 = f"{job.world.members[0].pod}.0"
    assert writers == {rank0}, writers


def audit_one_epoch(job: LocalJob) -> Traces:
    t = Traces.load(job.workdir / "trace")
    assert_every_sample_once(t, SAMPLES, 1)
    assert_params_identical(t)
    return t


def test_a_pod_restarted_in_place_rejoins_with_all_its_ranks(tmp_path: Path) -> None:
    # restartPolicy OnFailure: the kubelet restarts the container that the entry point
    # ended after its rank died; the pod's three ranks rejoin without state.
    # The survivors train on while the pod restarts: held at step 16 (a commit) until it
    # is back, they would otherwise finish without it.
    gate = tmp_path / "gate"
    gate.touch()
    env = {"TRACE_DIR": str(tmp_path / "trace"), "EPOCHS": str(EPOCHS),
           "SAMPLES": str(SAMPLES), "BATCH": "4", "COMMIT_EVERY": "4", "STEP_SLEEP": "0.03",
           "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR",
           "GATE_FILE": str(gate), "GATE_STEP": "16"}
    with LocalJob([sys.executable, str(WORKER)], tmp_path, env=env, procs_per_pod=LOCAL,
                  restart=True) as job:
        job.start(2)
        wait_for_step(job, 6)
        victim = job.world.members[LOCAL].pod
        wait_until(job, "the victim's local ranks",
                   lambda: len(local_ranks_of(job, victim)) == LOCAL)
        os.kill(local_ranks_of(job, victim)[2], signal.SIGKILL)
        wait_until(job, "the restarted pod to be back", lambda: job.world.size == 2 * LOCAL
                   and job.world.generation >= 2)
        gate.unlink()
        finish(job)

        assert job.pod(victim).restarts == 1
        assert job.world.size == 2 * LOCAL and job.world.generation >= 1
        t = audit(job)
        last = job.world.generation
        assert {r["size"] for r in t.starts(last).values()} == {2 * LOCAL}
        assert len(t.starts(last)) == 2 * LOCAL
        assert_resumed_from_commit(t, before=last - 1, after=last)


def test_a_planned_scale_down_lets_the_leaving_pods_ranks_exit_zero(job: LocalJob) -> None:
    gate = hold_at_gate(job)
    job.start(3)
    wait_for_step(job, GATE_STEP)
    leaver = job.world.pods[-1]
    job.scale(2)
    gate.unlink()
    codes = finish(job)

    assert codes[leaver] == 0  # every rank of the pod left cleanly
    assert job.world.size == 2 * LOCAL and leaver not in job.world.pods
    t = audit(job)
    assert_resumed_from_commit(t, before=0, after=1)
    assert_no_rollback(t)
