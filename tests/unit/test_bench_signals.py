"""The recovery bench signals a worker by a pid read from its traces only while that pid
still runs the worker's script: a pid reused by another process is left alone."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.bench.recovery_common import signal_running


@pytest.fixture()
def sleepers(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[bytes],
                                                 subprocess.Popen[bytes]]]:
    script = tmp_path / "worker.py"
    script.write_text("import time\ntime.sleep(120)\n")
    other = tmp_path / "other.py"
    other.write_text(script.read_text())
    worker = subprocess.Popen([sys.executable, str(script)])
    stranger = subprocess.Popen([sys.executable, str(other)])
    yield script, worker, stranger
    for proc in (worker, stranger):
        proc.kill()
        proc.wait()


def test_only_a_process_running_the_script_is_signalled(
        sleepers: tuple[Path, subprocess.Popen[bytes], subprocess.Popen[bytes]]) -> None:
    script, worker, stranger = sleepers
    done = signal_running([worker.pid, stranger.pid, 2**22 + 1], script, signal.SIGKILL)
    assert done == [worker.pid]
    assert worker.wait(timeout=30) == -signal.SIGKILL
    assert stranger.poll() is None
