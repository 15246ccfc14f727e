"""The porting guide: a plain DDP script and its ringwright version both run, the
ported one survives a SIGKILL with every sample of each epoch trained once, and
docs/porting.md shows the current difference between them, with its size."""

from __future__ import annotations

import difflib
import itertools
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

from ringwright.runtime import ElasticSampler
from ringwright.runtime.local.launcher import LocalJob, free_port
from tests.runtime.test_elastic_processes import DEADLINE_S, finish, log_tails

ROOT = Path(__file__).resolve().parents[2]
PLAIN = ROOT / "examples" / "ddp_plain.py"
PORTED = ROOT / "examples" / "ddp_ringwright.py"
GUIDE = ROOT / "docs" / "porting.md"
SAMPLES = 960
"""Twenty steps per epoch in a world of three (16 samples per rank and step)."""
BATCH, SEED = 16, 1
"""The batch size and the sampler's seed of examples/ddp_ringwright.py: a missing record's
share follows from them."""
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


def missing_records(step: int, last: dict[int, dict[str, Any]],
                    size: int) -> list[dict[str, Any]]:
    """Records of ``step`` for the ranks of a world of ``size`` that logged none, with
    the shares the sampler's partition gives them of the one global batch whose
    partition gives every rank that did log exactly the indices it logged."""
    epoch = next(iter(last.values()))["epoch"]
    assert {r["epoch"] for r in last.values()} == {epoch}, f"step {step}: {last}"
    sampler = ElasticSampler(SAMPLES, BATCH, seed=SEED)
    sampler.epoch = epoch
    order = sampler.order()

    def share(offset: int, rank: int) -> list[int]:
        sampler.offset = offset
        sampler.set_world(rank, size)
        return sampler.batch()

    first = order.index(next(iter(last.values()))["indices"][0])
    offsets = [offset for offset in range(max(0, first - size * (BATCH + 1)), first + 1)
               if all(share(offset, rank) == r["indices"] for rank, r in last.items())]
    assert len(offsets) == 1, (
        f"step {step}: the logged shares {last} are not one global batch's")
    return [{"rank": rank, "size": size, "step": step, "epoch": epoch,
             "indices": share(offsets[0], rank)} for rank in range(size) if rank not in last]


def trained_per_epoch(records: list[dict[str, Any]]) -> dict[int, Counter[int]]:
    """Counting, for every step, its last attempt: the ranks of the world that trained
    it last, each rank's latest record of it.

    Only the last step of a world that then lost a member may lack records. SIGKILL
    can land after the killed rank's part of a step's all-reduce and before it logs
    the step: the survivors' all-reduce, which cannot finish without every rank's
    gradients, completes, and they log the step. If it was due for a commit (commits
    are local), the survivors roll back to it when the next step's all-reduce fails
    and never train it again, so the killed rank's share of it counts: the one the
    sampler's partition gives it, derived from the logged shares. A step the killed
    rank took no part in did not complete at the old size; the smaller world trained
    it again, and that attempt, complete, is the step's last. The kill below follows
    the first record of step 10, the step a commit follows, so this happens."""
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_step[r["step"]].append(r)
    last_attempts: list[tuple[int, int, dict[int, dict[str, Any]]]] = []
    for step, attempts in sorted(by_step.items()):
        size = max(attempts, key=lambda r: r["t"])["size"]
        latest = {}
        for r in sorted(attempts, key=lambda r: r["t"]):
            latest[r["rank"]] = r
        last = {rank: latest[rank] for rank in range(size) if rank in latest}
        assert {r["size"] for r in last.values()} == {size}, f"step {step}: mixed attempts {last}"
        last_attempts.append((step, size, last))
    shrunk_after = {step for (step, size, _), (_, smaller, _) in
                    itertools.pairwise(last_attempts) if smaller < size}
    per_epoch: dict[int, Counter[int]] = defaultdict(Counter)
    for step, size, last in last_attempts:
        assert len(last) == size or step in shrunk_after, (
            f"step {step}: no record of ranks {sorted(set(range(size)) - set(last))}, "
            "yet the world that trained it trained on")
        missing = missing_records(step, last, size) if len(last) < size else []
        for r in [*last.values(), *missing]:
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
