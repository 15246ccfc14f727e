"""The porting guide: a plain DDP script and its ringwright version both run, the
ported one survives a SIGKILL with every sample of each epoch trained once, and
docs/porting.md shows the current difference between them, with its size."""

from __future__ import annotations

import difflib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from ringwright.runtime.local.launcher import LocalJob, free_port
from tests.runtime.test_elastic_processes import DEADLINE_S, finish, log_tails

ROOT = Path(__file__).resolve().parents[2]
PLAIN = ROOT / "examples" / "ddp_plain.py"
PORTED = ROOT / "examples" / "ddp_ringwright.py"
GUIDE = ROOT / "docs" / "porting.md"
SAMPLES = 960
"""Twenty steps per epoch in a world of three (16 samples per rank and step)."""
EPOCHS = 2

pytestmark = pytest.mark.timeout(420)


def code_lines(path: Path) -> list[str]:
    """The script without its module docstring (what a user edits when porting)."""
    text = path.read_text()
    body = text.split('"""', 2)[2]
    return body.lstrip("\n").splitlines()


def porting_diff() -> tuple[list[str], dict[str, int]]:
    """The unified diff from the plain script to the ported one, and its size: lines
    removed and added, also when indentation is ignored, and the plain script's lines."""
    plain, ported = code_lines(PLAIN), code_lines(PORTED)
    diff = list(difflib.unified_diff(plain, ported, "ddp_plain.py", "ddp_ringwright.py",
                                     lineterm="", n=1))
    added = sum(1 for d in diff[2:] if d.startswith("+"))
    removed = sum(1 for d in diff[2:] if d.startswith("-"))
    strip = [line.strip() for line in plain], [line.strip() for line in ported]
    loose = list(difflib.unified_diff(*strip, lineterm="", n=0))
    return diff, {
        "added": added, "removed": removed,
        "added_ignoring_indentation": sum(1 for d in loose[2:] if d.startswith("+")),
        "removed_ignoring_indentation": sum(1 for d in loose[2:] if d.startswith("-")),
        "plain_lines": sum(1 for line in plain if line.strip()),
    }


def test_the_guide_shows_the_current_diff_and_its_size() -> None:
    diff, size = porting_diff()
    guide = GUIDE.read_text()
    shown = re.search(r"```diff\n(.*?)```", guide, re.S)
    assert shown, "docs/porting.md has no ```diff block"
    assert shown.group(1).splitlines() == diff, (
        "docs/porting.md shows an old diff; paste this one:\n" + "\n".join(diff))
    for name, value in size.items():
        assert f"<!-- {name} -->{value}<!-- -->" in guide, (
            f"docs/porting.md: {name} is {value} now")


def read_log(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by SIGKILL
    return records


def trained_per_epoch(records: list[dict[str, Any]]) -> dict[int, Counter[int]]:
    """Counting, for every step, its last attempt: the ranks of the world that trained
    it last, each rank's latest record of it."""
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_step[r["step"]].append(r)
    per_epoch: dict[int, Counter[int]] = defaultdict(Counter)
    for step, attempts in sorted(by_step.items()):
        size = max(attempts, key=lambda r: r["t"])["size"]
        latest = {}
        for r in sorted(attempts, key=lambda r: r["t"]):
            latest[r["rank"]] = r
        last = [latest[rank] for rank in range(size)]
        assert {r["size"] for r in last} == {size}, f"step {step}: mixed attempts {last}"
        for r in last:
            per_epoch[r["epoch"]].update(r["indices"])
    return per_epoch


def assert_every_sample_once(records: list[dict[str, Any]]) -> None:
    per_epoch = trained_per_epoch(records)
    assert sorted(per_epoch) == list(range(EPOCHS))
    for epoch, counts in per_epoch.items():
        assert counts == Counter(range(SAMPLES)), (
            f"epoch {epoch}: missing {sorted(set(range(SAMPLES)) - set(counts))}, "
            f"repeated {sorted(i for i, n in counts.items() if n > 1)}")


def script_env(log: Path) -> dict[str, str]:
    return {"EPOCHS": str(EPOCHS), "SAMPLES": str(SAMPLES), "TRAIN_LOG": str(log),
            "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}


def test_the_plain_ddp_script_trains_two_processes_on_loopback(tmp_path: Path) -> None:
    log = tmp_path / "train.jsonl"
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(PLAIN)], cwd=tmp_path,
            stdout=(tmp_path / f"rank{rank}.out").open("w"), stderr=subprocess.STDOUT,
            env={**os.environ, **script_env(log), "RANK": str(rank), "WORLD_SIZE": "2",
                 "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)})
        for rank in range(2)]
    try:
        codes = [p.wait(timeout=DEADLINE_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outputs = "\n".join((tmp_path / f"rank{r}.out").read_text()[-1500:] for r in range(2))
    assert codes == [0, 0], outputs
    assert_every_sample_once(read_log(log))


def test_the_ported_script_survives_a_sigkill_with_exact_accounting(tmp_path: Path) -> None:
    log = tmp_path / "train.jsonl"
    env = {**script_env(log), "STEP_SLEEP": "0.05"}
    with LocalJob([sys.executable, str(PORTED)], tmp_path, env=env) as job:
        job.start(3)
        deadline = time.monotonic() + DEADLINE_S
        while not log.exists() or max((r["step"] for r in read_log(log)), default=0) < 10:
            assert time.monotonic() < deadline, f"no step 10 yet\n{log_tails(job)}"
            time.sleep(0.05)
        victim = job.world.members[1].pod
        job.kill(victim, signal.SIGKILL)
        codes = finish(job)
        assert codes[victim] == -signal.SIGKILL
        assert job.world.size == 2
    records = read_log(log)
    assert {r["size"] for r in records} == {3, 2}, "trained at three, then at two"
    assert_every_sample_once(records)
