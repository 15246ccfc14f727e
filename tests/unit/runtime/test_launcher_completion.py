"""Once a member finished, the local launcher restarts no crashed process: the job is
completing, so a restarted process would wait for a world whose peers have exited, and
``LocalJob.wait`` would wait for it."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import pytest

from ringwright.runtime.local.launcher import LocalJob

# worker-0 finishes at once; worker-1 crashes once told the launcher saw worker-0 finish.
WORKER = """
import os, sys, time
if os.environ["RINGWRIGHT_POD_NAME"].endswith("-0"):
    sys.exit(0)
go = os.path.join(sys.argv[1], "go")
while not os.path.exists(go):
    time.sleep(0.02)
sys.exit(3)
"""


def test_a_member_crashing_after_another_finished_is_not_restarted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    job = LocalJob([sys.executable, "-c", WORKER, str(tmp_path)], tmp_path / "job",
                   job="done", restart=True, capture_logs=False)
    with job:
        job.start(2)
        deadline = time.monotonic() + 60
        while "pod_finished" not in caplog.text:
            assert time.monotonic() < deadline, "the launcher never saw worker-0 finish"
            time.sleep(0.02)
        (tmp_path / "go").touch()
        codes = job.wait(timeout=60)
    assert codes == {"done-worker-0": 0, "done-worker-1": 3}
    assert job.pod("done-worker-1").restarts == 0
    assert "pod_restarted" not in caplog.text
