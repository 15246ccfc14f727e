"""SIGTERM to a whole job writes a final checkpoint; a fresh job resumes from it exactly.

Real worker processes on loopback (the same worker as the elastic tests) with a
checkpoint folder: every pod gets SIGTERM, as on preemption or a node drain; rank 0
writes the step it stopped at and waits for the write; every process exits with 143.
A new job started afterwards from nothing but that folder resumes at that step with
bit-identical parameters, and trains on to the end.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ringwright.runtime.checkpoint.checkpointer import Checkpointer
from ringwright.runtime.checkpoint.storage import LocalStorage
from ringwright.runtime.local.launcher import LocalJob
from tests.runtime.elastic_traces import Traces
from tests.runtime.elastic_worker import FEATURES, param_hash

WORKER = Path(__file__).with_name("elastic_worker.py")
DEADLINE_S = 240.0

pytestmark = pytest.mark.timeout(420)


def env(trace: Path, checkpoints: Path) -> dict[str, str]:
    return {"TRACE_DIR": str(trace), "CHECKPOINT_DIR": str(checkpoints), "EPOCHS": "2",
            "SAMPLES": "192", "BATCH": "4", "COMMIT_EVERY": "4", "STEP_SLEEP": "0.03",
            "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}


def wait_until(what: str, probe: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def saved_model_hash(payload: dict[str, object]) -> str:
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 1))
    model.load_state_dict(payload["model"])  # type: ignore[arg-type]
    return param_hash(model)


def test_sigterm_flushes_a_final_checkpoint_and_a_full_restart_resumes_identically(
        tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    first = tmp_path / "first"
    with LocalJob([sys.executable, str(WORKER)], first,
                  env=env(first / "trace", checkpoints)) as job:
        job.start(2)
        wait_until("training past step 9", lambda: max(
            (r["step"] for _, r in Traces.load(first / "trace").events("stepped")),
            default=0) >= 9)
        pods = [m.pod for m in job.world.members]
        for pod in pods:
            job.kill(pod, signal.SIGTERM)
        codes = job.wait(DEADLINE_S)
    assert {codes[p] for p in pods} == {128 + signal.SIGTERM}, codes

    (final,) = [r for _, r in Traces.load(first / "trace").events("terminated")
                if r["rank"] == 0]
    assert final["flushed"], "rank 0 waited for its final write"
    restored = Checkpointer(LocalStorage(checkpoints)).restore_latest()
    assert restored is not None
    # Rank 0 flushes the state of the step it stopped at, or the last commit (8, the one
    # before step 9) when its peer stopped first and the step under way rolled back.
    assert restored.payload["step"] == final["step"] >= 8
    assert saved_model_hash(restored.payload) == final["hash"]

    second = tmp_path / "second"
    with LocalJob([sys.executable, str(WORKER)], second,
                  env=env(second / "trace", checkpoints)) as job:
        job.start(2)
        codes = job.wait(DEADLINE_S)
    assert set(codes.values()) == {0}, codes
    resumed = Traces.load(second / "trace")
    starts = resumed.starts(0)
    assert {r["step"] for r in starts.values()} == {final["step"]}
    assert {r["hash"] for r in starts.values()} == {final["hash"]}
    steps_per_data_epoch = 192 // (4 * 2)
    assert max(r["step"] for _, r in resumed.events("stepped")) == 2 * steps_per_data_epoch


def test_an_emptied_world_has_rank_zero_checkpoint_the_last_commit_before_leaving(
        tmp_path: Path) -> None:
    """A job being suspended (or evicted by a queue) first gets a world without members,
    before its pods get SIGTERM: the members leave cleanly at a commit, and rank 0 writes
    that commit first (no interval is set here, so nothing else would write it)."""
    checkpoints, gate = tmp_path / "checkpoints", tmp_path / "gate"
    gate.touch()
    held = {**env(tmp_path / "trace", checkpoints), "GATE_FILE": str(gate), "GATE_STEP": "12"}
    with LocalJob([sys.executable, str(WORKER)], tmp_path / "job", env=held) as job:
        job.start(2)
        wait_until("training held at step 12", lambda: max(
            (r["step"] for _, r in Traces.load(tmp_path / "trace").events("stepped")),
            default=0) >= 12)
        job.scale(0)
        gate.unlink()
        codes = job.wait(DEADLINE_S)
    assert set(codes.values()) == {0}, codes
    commits = [r["step"] for _, r in Traces.load(tmp_path / "trace").events("commit")
               if r["rank"] == 0]
    restored = Checkpointer(LocalStorage(checkpoints)).restore_latest()
    assert restored is not None, "nothing was checkpointed before the members left"
    assert restored.payload["step"] == max(commits) >= 12
