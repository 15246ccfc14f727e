"""NCCL on real GPUs: a member killed mid-training, survivors abort and carry on.

Needs two or more CUDA devices (NCCL refuses two ranks on one GPU); marked ``gpu``.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
import torch

from ringwright.runtime.local.launcher import LocalJob
from ringwright.runtime.settings import SettingsEnv
from ringwright.world import Env
from tests.runtime.elastic_traces import assert_resumed_from_commit
from tests.runtime.test_elastic_processes import WORKER, audit, finish, wait_for_step

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(420)]


@pytest.fixture()
def gpus() -> int:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        pytest.skip(f"needs 2 or more CUDA devices, found {count}")
    return min(count, 4)


def test_nccl_kill_one_of_n_survivors_continue(tmp_path: Path, gpus: int) -> None:
    env = {
        Env.BACKEND: "torch", "CUDA": "1", "TRACE_DIR": str(tmp_path / "trace"),
        "EPOCHS": "2", "SAMPLES": "192", "BATCH": "4", "COMMIT_EVERY": "4",
        "STEP_SLEEP": "0.03", "OMP_NUM_THREADS": "1",
        SettingsEnv.FAILURE_DETECT: "3", SettingsEnv.COLLECTIVE_TIMEOUT: "600",
    }
    with LocalJob([sys.executable, str(WORKER)], tmp_path, env=env) as job:
        job.start(gpus)
        wait_for_step(job, 6)
        victim = job.world.members[gpus - 1].pod
        job.kill(victim, signal.SIGKILL)
        codes = finish(job)
        assert codes[victim] == -signal.SIGKILL
        assert job.world.size == gpus - 1
        t = audit(job)
        assert_resumed_from_commit(t, before=0, after=job.world.generation)
