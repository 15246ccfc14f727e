"""Checkpoints survive the death of the process writing them.

Real writer processes are SIGKILLed at random moments and before every single storage
operation of a save, and a training process gets SIGTERM mid-loop; after each, a fresh
reader must restore the last complete checkpoint with identical tensors.

Importing torch costs seconds, so the processes are forked from one long-lived helper
process (this file run as a script with ``zygote``) that imported it once. The test
process signals the forked writers directly; they report progress by appending lines to
an events file, which survives their death.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ringwright.runtime.checkpoint import snapshot as checkpoint_snapshot
from ringwright.runtime.checkpoint.checkpointer import (
    Checkpointer,
    CheckpointPolicy,
    LocalStorage,
    TerminationSignal,
)
from ringwright.runtime.checkpoint.storage import Bytes, StagedFile

KEEP = 2
RANDOM_KILLS = 24
SEED = 20240611

# --- helpers shared by the test process and the forked children -----------------------


def _payload_for(step: int) -> dict[str, Any]:
    """What a writer saves at ``step``: about 1 MB, every value derived from the step."""
    return {
        "weights": torch.full((256, 1024), float(step)),
        "bias": torch.arange(1000, dtype=torch.int64) * step,
        "counters": {"step": step, "samples": step * 32},
    }


def _emit(events: str, line: str) -> None:
    # One write() per line with O_APPEND: a line is either fully there or absent.
    fd = os.open(events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _read_events(events: Path) -> list[str]:
    return events.read_text().splitlines() if events.exists() else []


class _DyingStorage(LocalStorage):
    """Local storage that SIGKILLs its own process just before mutating op number ``n``."""

    def __init__(self, root: str, events: str, die_before: int) -> None:
        super().__init__(root)
        self._events = events
        self._left = die_before

    def _op(self, what: str) -> None:
        if self._left == 0:
            _emit(self._events, f"dying before {what}")
            os.kill(os.getpid(), signal.SIGKILL)
        _emit(self._events, f"op {what}")
        self._left -= 1

    def create(self, name: str) -> StagedFile:
        self._op(f"create {name}")
        staged = super().create(name)
        storage = self

        class Staged:
            def write(self, data: Bytes) -> None:
                storage._op(f"write {name}")
                staged.write(data)

            def commit(self) -> None:
                storage._op(f"commit {name}")
                staged.commit()

            def abort(self) -> None:
                staged.abort()

        return Staged()

    def delete(self, name: str) -> None:
        self._op(f"delete {name}")
        super().delete(name)


# --- roles run in forked children -------------------------------------------------------


def writer(root: str, events: str, saves: int, die_before: int = -1) -> None:
    """Restore the newest checkpoint, then save ``saves`` further steps (-1: forever)."""
    # Small chunks, so that a kill can land between two writes of one data file.
    checkpoint_snapshot.CHUNK_BYTES = 256 << 10
    storage = LocalStorage(root) if die_before < 0 else _DyingStorage(root, events, die_before)
    ckpt = Checkpointer(storage, keep=KEEP)
    restored = ckpt.restore_latest()
    step = restored.meta.step if restored else 0
    _emit(events, f"restored {step}")
    while saves != 0:
        saves -= 1
        step += 1
        ckpt.save(step, _payload_for(step), {"epoch": step // 10, "world_size": 2})
        ckpt.flush()
        _emit(events, f"committed {step}")
    ckpt.close()


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    # The batch depends on the step alone, as an elastic sampler's would: a resumed
    # run sees exactly the batches the uninterrupted one saw.
    batch = torch.Generator().manual_seed(1000 + step)
    inputs = torch.randn(16, 32, generator=batch)
    targets = torch.randn(16, 8, generator=batch)
    optimizer.zero_grad()
    torch.autograd.backward(torch.nn.functional.mse_loss(model(inputs), targets))
    optimizer.step()


def trainer(root: str, events: str, expected: str, max_steps: int) -> None:
    """A training loop with periodic checkpoints and a final one on SIGTERM.

    Leaves its final parameters and optimizer state in ``expected`` for comparison.
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(LocalStorage(root), keep=KEEP)
    step = 0
    restored = ckpt.restore_latest()
    if restored is not None:
        model.load_state_dict(restored.payload["model"])
        optimizer.load_state_dict(restored.payload["optimizer"])
        step = restored.payload["counters"]["step"]

    def payload() -> dict[str, Any]:
        return {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "counters": {"step": step},
        }

    policy = CheckpointPolicy(interval_steps=10)
    stop = TerminationSignal(grace_seconds=30).install()
    last_step, last_time = step, time.monotonic()
    _emit(events, f"started {step}")
    outcome = "done"
    while step < max_steps:
        _train_step(model, optimizer, step)
        step += 1
        _emit(events, f"step {step}")
        if stop.requested:
            if ckpt.last_saved_step != step:
                ckpt.save(step, payload(), {"world_size": 1})
            outcome = "final" if ckpt.flush(timeout=stop.remaining()) else "late"
            break
        if policy.due(step=step, now=time.monotonic(), last_step=last_step, last_time=last_time):
            ckpt.save(step, payload(), {"world_size": 1})
            last_step, last_time = step, time.monotonic()
    ckpt.close()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, expected)
    _emit(events, f"{outcome} {step}")


ROLES: dict[str, Callable[..., None]] = {"writer": writer, "trainer": trainer}


def _zygote() -> None:
    """Fork a child per request on stdin; answer with JSON lines on stdout."""
    torch.set_num_threads(1)  # inherited by the children: deterministic and 2-core friendly
    # The first optimizer imports torch's compiler stack (seconds): pay that here once.
    torch.optim.Adam(torch.nn.Linear(1, 1).parameters())
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "start":
            pid = os.fork()
            if pid == 0:
                _child(request["role"], request["args"], request["log"])
            print(json.dumps({"pid": pid}), flush=True)
        elif request["op"] == "wait":
            _, status = os.waitpid(request["pid"], 0)
            print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)
    # Nothing to clean up, and tearing down an interpreter with torch loaded takes seconds.
    os._exit(0)


def _child(role: str, args: dict[str, Any], log: str) -> None:
    code = 1
    try:
        # Keep the zygote's pipes for the zygote: the child logs to a file.
        log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        ROLES[role](**args)
        code = 0
    except BaseException:
        traceback.print_exc()
        _emit(args["events"], "error")
    finally:
        os._exit(code)


# --- the test process side --------------------------------------------------------------


class Zygote:
    """The test's handle on the forking helper process."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._reply().get("ready"), "the helper process did not start"
        self._count = 0

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"helper process died with {self.proc.wait()}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def start(self, role: str, **args: Any) -> tuple[int, Path]:
        """Fork ``role(**args)``; returns its pid and its log file."""
        self._count += 1
        log = self.logs / f"{role}-{self._count}.log"
        pid: int = self._ask({"op": "start", "role": role, "args": args, "log": str(log)})["pid"]
        return pid, log

    def wait(self, pid: int) -> int:
        """Reap ``pid``; its return code (negative: killed by that signal)."""
        code: int = self._ask({"op": "wait", "pid": pid})["returncode"]
        return code

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    helper = Zygote(tmp_path_factory.mktemp("checkpoint-child-logs"))
    yield helper
    helper.close()


def _wait_for(events: Path, log: Path, accept: Callable[[list[str]], bool]) -> list[str]:
    """Poll ``events`` until ``accept`` says yes; fail on a child error or after 120 s.

    The deadline only keeps a broken child from hanging the suite; no assertion
    depends on how fast anything runs.
    """
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        lines = _read_events(events)
        if "error" in lines:
            raise AssertionError(f"child failed:\n{log.read_text()}")
        if accept(lines):
            return lines
        time.sleep(0.005)
    raise AssertionError(f"child made no progress; events {lines[-5:]}; log:\n{log.read_text()}")


def _last_number(lines: list[str], word: str) -> int | None:
    numbers = [int(line.split()[1]) for line in lines if line.startswith(word + " ")]
    return numbers[-1] if numbers else None


def _assert_restores(root: Path, step: int) -> None:
    """A fresh reader restores exactly ``step``, the newest committed, with its tensors."""
    reader = Checkpointer(LocalStorage(root), keep=KEEP)
    assert reader.steps()[-1] == step, reader.steps()
    restored = reader.restore_latest()
    assert restored is not None and restored.meta.step == step
    expected = _payload_for(step)
    assert torch.equal(restored.payload["weights"], expected["weights"])
    assert torch.equal(restored.payload["bias"], expected["bias"])
    assert restored.payload["counters"] == expected["counters"]


def test_sigkill_at_random_moments_always_leaves_the_last_complete_checkpoint(
    zygote: Zygote, tmp_path: Path
) -> None:
    rng = random.Random(SEED)
    root = tmp_path / "ckpt"
    commits = 0
    mid_write = 0
    # At least RANDOM_KILLS kills, and more (bounded) until one has landed mid-write:
    # a run whose kills all fell between two writes would not test what it names.
    for round_ in range(3 * RANDOM_KILLS):
        if round_ >= RANDOM_KILLS and mid_write:
            break
        events = tmp_path / f"events-{round_}"
        pid, log = zygote.start("writer", root=str(root), events=str(events), saves=-1)
        # After its first commit the writer is busy writing the next checkpoint nearly
        # all the time: kill it a random moment later, wherever it happens to be.
        _wait_for(events, log, lambda lines: any(x.startswith("committed") for x in lines))
        time.sleep(rng.uniform(0.0, 0.12))
        os.kill(pid, signal.SIGKILL)
        assert zygote.wait(pid) == -signal.SIGKILL, log.read_text()
        mid_write += any("partial" in p.name for p in (root / "model").iterdir())
        lines = _read_events(events)
        started = _last_number(lines, "restored")
        confirmed = _last_number(lines, "committed") or started
        assert started is not None and confirmed is not None
        commits += confirmed - started
        reader = Checkpointer(LocalStorage(root))
        newest = reader.steps()[-1] if reader.steps() else 0
        # The kill may land after a commit and before its report, never later.
        assert newest in (confirmed, confirmed + 1), (newest, confirmed)
        if newest:
            _assert_restores(root, newest)
    print(f"{commits} checkpoints committed over {round_ + 1} kills, {mid_write} mid-write")
    assert commits >= RANDOM_KILLS
    assert mid_write, "no kill landed while a checkpoint file was being written"


def test_sigkill_before_each_storage_operation_of_a_save(zygote: Zygote, tmp_path: Path) -> None:
    base = tmp_path / "base"
    with Checkpointer(LocalStorage(base), keep=KEEP) as ckpt:
        for step in (1, 2):
            ckpt.save(step, _payload_for(step))
            ckpt.flush()
    died_before: list[str] = []
    for n in range(100):
        root = tmp_path / f"run-{n}"
        shutil.copytree(base, root)
        events = tmp_path / f"events-{n}"
        pid, log = zygote.start(
            "writer", root=str(root), events=str(events), saves=1, die_before=n
        )
        code = zygote.wait(pid)
        lines = _read_events(events)
        if code == 0:
            break  # the save needs fewer than n operations: all of them were covered
        assert code == -signal.SIGKILL, log.read_text()
        manifest_committed = any(
            line.startswith("op commit") and line.endswith("manifest.json") for line in lines
        )
        _assert_restores(root, 3 if manifest_committed else 2)
        died_before.append(lines[-1].removeprefix("dying before "))
    else:
        raise AssertionError("the save never completed")
    assert _last_number(lines, "committed") == 3
    _assert_restores(root, 3)
    kinds = {e.split()[0] + (" manifest" if "manifest" in e else "") for e in died_before}
    # Every phase was hit: data chunks, both commits, and pruning.
    assert {"create", "write", "commit", "commit manifest", "delete"} <= kinds, died_before


def _equal_states(a: dict[str, Any], b: dict[str, Any]) -> None:
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    for index, state in a["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, b["optimizer"]["state"][index][name]), (index, name)


def test_sigterm_flushes_a_final_checkpoint_and_a_restart_resumes_identically(
    zygote: Zygote, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    events = tmp_path / "events-interrupted"
    expected = tmp_path / "interrupted.pt"
    pid, log = zygote.start(
        "trainer", root=str(root), events=str(events), expected=str(expected), max_steps=10**9
    )
    _wait_for(events, log, lambda lines: "step 25" in lines)
    os.kill(pid, signal.SIGTERM)
    assert zygote.wait(pid) == 0, log.read_text()
    lines = _read_events(events)
    final = _last_number(lines, "final")
    assert final is not None and final >= 25, lines[-3:]

    # The final checkpoint is complete and holds exactly the state at exit.
    restored = Checkpointer(LocalStorage(root)).restore_latest()
    assert restored is not None and restored.meta.step == final
    _equal_states(torch.load(expected, weights_only=True), restored.payload)

    # A full restart resumes at that step and ends where an uninterrupted run ends.
    target = final + 15
    runs = {}
    for name, folder in (("resumed", root), ("uninterrupted", tmp_path / "fresh")):
        events = tmp_path / f"events-{name}"
        out = tmp_path / f"{name}.pt"
        pid, log = zygote.start(
            "trainer", root=str(folder), events=str(events), expected=str(out), max_steps=target
        )
        assert zygote.wait(pid) == 0, log.read_text()
        lines = _read_events(events)
        assert lines[0] == f"started {final if name == 'resumed' else 0}"
        assert lines[-1] == f"done {target}"
        runs[name] = torch.load(out, weights_only=True)
    _equal_states(runs["resumed"], runs["uninterrupted"])


if __name__ == "__main__" and sys.argv[1:] == ["zygote"]:
    _zygote()
