"""Training state across resizes, with real worker processes (gloo on loopback).

The worker (``state_worker.py``) trains a dropout model with AdamW, OneCycleLR, a
GradScaler and a user counter. A job that goes 4 -> 3 -> 4 through a SIGKILL (so two
steps are rolled back and trained again) and a scale-up must end bit-for-bit where a
job that goes 4 -> 3 -> 4 by planned changes at the same steps ends: only if the
generators, the schedule, the scaler and the counter were rolled back and sent to the
newcomer exactly does the replay draw the same dropout masks and take the same steps.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ringwright.runtime.checkpoint.checkpointer import Checkpointer
from ringwright.runtime.checkpoint.storage import LocalStorage
from ringwright.runtime.local.launcher import LocalJob
from ringwright.runtime.membership.file_source import write_world_file
from ringwright.world import CheckpointSettings, Env, LRRule, LRScaling
from tests.runtime.elastic_traces import Record, Traces
from tests.runtime.elastic_worker import param_hash
from tests.runtime.state_worker import new_model

WORKER = Path(__file__).with_name("state_worker.py")
ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 300.0
"""Generous: a loaded two-core machine needs tens of seconds just to import torch."""
GRACE_S = 20

pytestmark = pytest.mark.timeout(900)


def job_env(workdir: Path, **extra: str) -> dict[str, str]:
    return {"TRACE_DIR": str(workdir / "trace"), "GATE_DIR": str(workdir / "gates"),
            "EPOCHS": "2", "SAMPLES": "192", "BATCH": "4", "COMMIT_EVERY": "4",
            "STEP_SLEEP": "0.02", "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR",
            # The worker shares helpers with the tests: import them from the repository.
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                        os.environ.get("PYTHONPATH")])),
            Env.TERMINATION_GRACE: str(GRACE_S), **extra}


@pytest.fixture()
def make_job(tmp_path: Path) -> Iterator[Callable[..., LocalJob]]:
    jobs: list[LocalJob] = []

    def make(name: str, *, checkpoint: CheckpointSettings | None = None,
             settle_s: float = 0.3, env: dict[str, str] | None = None) -> LocalJob:
        workdir = tmp_path / name
        (workdir / "gates").mkdir(parents=True)
        job = LocalJob([sys.executable, str(WORKER)], workdir, env=job_env(workdir, **env or {}),
                       lr=LRScaling(rule=LRRule.LINEAR, base_world_size=4),
                       checkpoint=checkpoint, settle_s=settle_s)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.close()


def traces(job: LocalJob) -> Traces:
    return Traces.load(job.workdir / "trace")


def log_tails(job: LocalJob) -> str:
    return "\n".join(f"--- {name}\n{job.log_path(name).read_text()[-2000:]}"
                     for name in job.exit_codes() if job.log_path(name).exists())


def wait_until(job: LocalJob, what: str, probe: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not probe():
        crashed = {p: c for p, c in job.exit_codes().items() if c not in (None, 0, -9)}
        if crashed:
            raise AssertionError(f"workers crashed {crashed} waiting for {what}\n"
                                 f"{log_tails(job)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{log_tails(job)}")
        time.sleep(0.05)


def gate(job: LocalJob, step: int) -> Path:
    path = job.workdir / "gates" / str(step)
    path.touch()
    return path


def wait_at_gate(job: LocalJob, step: int, ranks: int) -> None:
    def there() -> bool:
        return len({pod for pod, r in traces(job).events("stepped")
                    if r["step"] == step}) >= ranks
    wait_until(job, f"{ranks} ranks at step {step}", there)


def finish(job: LocalJob) -> dict[str, int]:
    codes = job.wait(DEADLINE_S)
    failed = {m.pod: codes[m.pod] for m in job.world.members if codes[m.pod] != 0}
    assert not failed, f"members failed: {failed}\n{log_tails(job)}"
    return codes


def done_records(job: LocalJob) -> list[Record]:
    return [r for _, r in traces(job).events("done")]


def scale_up_at(job: LocalJob, step: int) -> None:
    """Once the three members hold at ``step``, add a pod; let them commit into the new
    world."""
    wait_at_gate(job, step, 3)
    job.scale(4)
    wait_until(job, "the newcomer to join the world", lambda: job.world.size == 4)
    (job.workdir / "gates" / str(step)).unlink()


def test_a_failure_run_4_3_4_matches_a_planned_replay_from_the_same_commits(
        make_job: Callable[..., LocalJob]) -> None:
    # Failure run: SIGKILL rank 3 at step 10; the survivors roll back to the commit at
    # step 8, train 9 and 10 again at size 3; a newcomer joins at the commit at step 16.
    failing = make_job("failure")
    at_kill = gate(failing, 10)
    gate(failing, 16)
    failing.start(4)
    wait_at_gate(failing, 10, 4)
    failing.kill(failing.world.members[3].pod, signal.SIGKILL)
    at_kill.unlink()
    scale_up_at(failing, 16)
    finish(failing)

    # Replay: the same worlds from the same commits, by planned changes only.
    planned = make_job("planned")
    at_down = gate(planned, 8)
    gate(planned, 16)
    planned.start(4)
    wait_at_gate(planned, 8, 4)
    planned.scale(3)
    at_down.unlink()
    scale_up_at(planned, 16)
    finish(planned)

    ft, pt = traces(failing), traces(planned)
    sizes_at = {r["step"]: r["size"] for _, r in ft.events("start")}
    assert sizes_at == {r["step"]: r["size"] for _, r in pt.events("start")} == \
        {0: 4, 8: 3, 16: 4}, "both went 4 -> 3 -> 4 from the commits at steps 8 and 16"
    retrained = [r for _, r in ft.events("stepped") if r["step"] in (9, 10)]
    assert {r["size"] for r in retrained} == {3, 4}, "steps 9 and 10 ran twice"

    (f_done, *f_rest), (p_done, *_) = done_records(failing), done_records(planned)
    assert all(r["hash"] == f_done["hash"] for r in f_rest), "every rank ends identical"
    for mine, theirs in zip(f_done["params"], p_done["params"], strict=True):
        assert torch.allclose(torch.tensor(mine), torch.tensor(theirs), rtol=0, atol=1e-6)
    for key in ("scaler", "seen", "optimizer"):
        assert f_done[key] == p_done[key], key

    # AdamW moments, schedule and scaler identical on every rank once the newcomer joined.
    for t in (ft, pt):
        joined = t.starts(max(t.generations()))
        assert len(joined) == 4
        for key in ("optimizer", "schedule", "scaler", "seen", "hash", "lr"):
            assert len({str(r[key]) for r in joined.values()}) == 1, key


def wait_for_log(job: LocalJob, pod: str, text: str) -> None:
    wait_until(job, f"{text!r} in {pod}'s log",
               lambda: text in job.log_path(pod).read_text())


def kubelet_stop(job: LocalJob, pods: list[str]) -> dict[str, int]:
    """SIGTERM, then SIGKILL whoever is still running once the grace period is over."""
    for pod in pods:
        job.kill(pod, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and any(job.exit_codes()[p] is None for p in pods):
        time.sleep(0.05)
    for pod in pods:
        if job.exit_codes()[pod] is None:
            job.kill(pod, signal.SIGKILL)
    for pod in pods:
        job.pod(pod).process.wait()
    return {p: c for p, c in job.exit_codes().items() if p in pods and c is not None}


def checkpoint_hash(path: Path) -> tuple[int, str]:
    restored = Checkpointer(LocalStorage(path)).restore_latest()
    assert restored is not None, "a final checkpoint was written"
    model = new_model()
    model.load_state_dict(restored.payload["model"])
    return int(restored.payload["step"]), param_hash(model)


def commit_hash(job: LocalJob, step: int) -> str:
    (digest,) = {r["hash"] for _, r in traces(job).events("commit") if r["step"] == step}
    return str(digest)


def test_sigterm_while_forming_exits_143_in_the_grace_with_a_checkpoint_of_the_last_commit(
        make_job: Callable[..., LocalJob], tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    # No periodic checkpoints: whatever is on disk is the final one.
    job = make_job("forming", checkpoint=CheckpointSettings(path=str(checkpoints)))
    held = gate(job, 10)
    job.start(2)
    wait_at_gate(job, 10, 2)
    # A world with a third member that will never arrive: the two form it and wait.
    ghost = job.world.members[1].model_copy(update={"rank": 2, "pod": "ghost",
                                                    "ip": "127.0.0.250"})
    write_world_file(job.world_file, job.world.model_copy(
        update={"generation": 1, "members": (*job.world.members, ghost)}))
    held.unlink()
    pods = [m.pod for m in job.world.members]
    for pod in pods:
        wait_for_log(job, pod, "world_change_agreed")
    codes = kubelet_stop(job, pods)
    assert codes == dict.fromkeys(pods, 128 + signal.SIGTERM), log_tails(job)
    assert checkpoint_hash(checkpoints) == (12, commit_hash(job, 12))
    assert "stop_while_forming" in job.log_path(pods[0]).read_text()


def test_sigterm_while_waiting_for_a_world_exits_143_with_a_checkpoint_of_the_last_commit(
        make_job: Callable[..., LocalJob], tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    job = make_job("waiting", checkpoint=CheckpointSettings(path=str(checkpoints)))
    held = gate(job, 10)
    job.start(2)
    wait_at_gate(job, 10, 2)
    survivor, victim = (m.pod for m in job.world.members)
    # The operator down: the next world never comes. (Up, it would publish the world of
    # one at once, as the survivor waits for it, and the survivor would train on.)
    with job.paused():
        job.kill(victim, signal.SIGKILL)
        held.unlink()
        wait_for_log(job, survivor, "rolled_back")
        codes = kubelet_stop(job, [survivor])
    assert codes == {survivor: 128 + signal.SIGTERM}, log_tails(job)
    assert checkpoint_hash(checkpoints) == (8, commit_hash(job, 8))


def test_the_job_spec_alone_checkpoints_and_a_fresh_job_resumes(
        make_job: Callable[..., LocalJob], tmp_path: Path) -> None:
    spec = CheckpointSettings(path=str(tmp_path / "checkpoints"), intervalSteps=4, keep=2)
    first = make_job("first", checkpoint=spec, env={"EPOCHS": "1"})
    first.start(2)
    finish(first)
    steps = Checkpointer(LocalStorage(spec.path)).steps()
    assert len(steps) == 2, "keep: 2"
    last = max(steps)
    assert last == max(r["step"] for _, r in traces(first).events("commit"))

    second = make_job("second", checkpoint=spec, env={"EPOCHS": "2"})
    second.start(2)
    finish(second)
    starts = traces(second).starts(0)
    assert {r["step"] for r in starts.values()} == {last}
    assert {r["hash"] for r in starts.values()} == {commit_hash(first, last)}


def test_an_unwritable_checkpoint_path_is_reported_and_training_completes(
        make_job: Callable[..., LocalJob], tmp_path: Path) -> None:
    volume = tmp_path / "volume"
    volume.write_text("a file where the checkpoint volume should be mounted")
    spec = CheckpointSettings(path=str(volume / "ckpt"), intervalSteps=4)
    job = make_job("unwritable", checkpoint=spec, env={"EPOCHS": "1"})
    job.start(2)
    codes = finish(job)
    assert set(codes.values()) == {0}, "no crash, no restart"
    rank0 = job.log_path(job.world.members[0].pod).read_text()
    assert "checkpoint_failed" in rank0
    report = next(line for line in rank0.splitlines()
                  if " report " in line and "kind=checkpoint-failed" in line)
    assert spec.path in report and "Not a directory" in report
