"""``python train.py`` with no job around it trains alone, as a world of one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_elastic.py"


def test_the_example_trains_alone_without_any_ringwright_environment(tmp_path: Path) -> None:
    # Nothing from a job: only what finds Python and this tree's packages.
    env = {k: v for k, v in os.environ.items()
           if k in ("PATH", "PYTHONPATH", "HOME", "LANG") or k.startswith("LC_")}
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--epochs", "2", "--samples", "256", "--device", "cpu"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert " solo_run " in out, out
    assert " joined " in out and "backend=solo" in out, out
    epochs = [line for line in out.splitlines() if " epoch_done " in line]
    assert len(epochs) == 2, out
    assert all("world_size=1" in line for line in epochs), epochs
    assert all("lr=0.01 " in line or line.endswith("lr=0.01") for line in epochs), epochs
    assert not list(tmp_path.iterdir()), "a solo run writes no world, reports or checkpoints"
