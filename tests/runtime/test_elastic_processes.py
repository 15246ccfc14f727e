"""Real worker processes training with gloo on loopback while the world changes.

The test plays the operator through :class:`LocalJob` (a world file), kills workers
with SIGKILL or resizes the job, and then audits the workers' traces: every sample
of every data epoch trained exactly once counting from the commits, parameters
bit-identical across ranks, training resumed from the last commit. No assertion
depends on how long anything took; waits are on observed progress.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ringwright.runtime.local.launcher import LocalJob
from ringwright.world import Env
from tests.runtime.elastic_traces import (
    Traces,
    assert_every_sample_once,
    assert_params_identical,
    assert_resumed_from_commit,
    assert_resumed_from_last_commit,
)

WORKER = Path(__file__).with_name("elastic_worker.py")
SAMPLES = 192
EPOCHS = 2
DEADLINE_S = 240.0
"""Generous: a loaded two-core machine needs tens of seconds just to import torch."""

GATE_STEP = 6
"""Workers hold after this step while the gate file exists (planned changes only)."""

pytestmark = pytest.mark.timeout(420)


BOTH_BACKENDS = pytest.mark.parametrize(
    "job", ["torch", pytest.param("horovod", marks=pytest.mark.horovod)], indirect=True)
"""Run a test with the torch.distributed backend and again with Horovod."""


def worker_env(tmp_path: Path, backend: str) -> dict[str, str]:
    """The test worker's environment: traces, the data, commits and the gate in
    ``tmp_path``."""
    return {
        Env.BACKEND: backend,
        "TRACE_DIR": str(tmp_path / "trace"),
        "EPOCHS": str(EPOCHS),
        "SAMPLES": str(SAMPLES),
        "BATCH": "4",
        "COMMIT_EVERY": "4",
        "STEP_SLEEP": "0.03",
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        "OMP_NUM_THREADS": "1",
        "GATE_FILE": str(tmp_path / "gate"),
        "GATE_STEP": str(GATE_STEP),
    }


@pytest.fixture()
def job(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LocalJob]:
    env = worker_env(tmp_path, getattr(request, "param", "torch"))
    with LocalJob([sys.executable, str(WORKER)], tmp_path, env=env) as local_job:
        yield local_job


def traces(job: LocalJob) -> Traces:
    return Traces.load(job.workdir / "trace")


def log_tails(job: LocalJob) -> str:
    return "\n".join(
        f"--- {name}\n{job.log_path(name).read_text()[-1500:]}"
        for name in job.exit_codes() if job.log_path(name).exists()
    )


def wait_until(job: LocalJob, what: str, probe: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{log_tails(job)}")
        time.sleep(0.05)


def wait_for_step(job: LocalJob, step: int) -> None:
    wait_until(job, f"training to reach step {step}", lambda: traces(job).max_step() >= step)


def audit(job: LocalJob) -> Traces:
    t = traces(job)
    assert_every_sample_once(t, SAMPLES, EPOCHS)
    assert_params_identical(t)
    # The library the user's code talks to agrees with the world on every start.
    for starts in (t.starts(e) for e in t.generations()):
        assert all((r["lib_rank"], r["lib_size"]) == (r["rank"], r["size"])
                   for r in starts.values())
    return t


def assert_no_rollback(t: Traces) -> None:
    """No member's training was cut by a failure, and no world redid completed steps."""
    failures = [(pod, r["why"]) for pod, r in t.events("interrupted")
                if r["why"] != "WorldChanged"]
    assert failures == []
    assert t.rollbacks() == []


def stacks(job: LocalJob) -> str:
    """The threads of every process still running (elastic_worker.py writes them to its
    ``.stacks`` file on SIGUSR1): what a job that never ended was waiting on."""
    running = [name for name, code in job.exit_codes().items() if code is None]
    for name in running:
        with contextlib.suppress(ProcessLookupError):
            job.kill(name, signal.SIGUSR1)
    time.sleep(1.0)
    dumps = {name: job.workdir / "trace" / f"{name}.stacks" for name in running}
    return "\n".join(f"--- {name}: threads\n{path.read_text(errors='replace')[-4000:]}"
                     for name, path in dumps.items() if path.exists())


def finish(job: LocalJob) -> dict[str, int]:
    try:
        codes = job.wait(DEADLINE_S)
    except TimeoutError as err:
        raise AssertionError(f"{err}\n{stacks(job)}") from err
    failed = {m.pod: codes[m.pod] for m in job.world.members if codes[m.pod] != 0}
    assert not failed, f"members failed: {failed}\n{log_tails(job)}"
    return codes


@BOTH_BACKENDS
def test_sigkill_one_of_four_survivors_continue_at_three(job: LocalJob) -> None:
    gate = hold_late(job)
    job.start(4)
    wait_for_step(job, 6)
    victim = job.world.members[2].pod
    job.kill(victim, signal.SIGKILL)
    gate.unlink()
    codes = finish(job)

    assert codes[victim] == -signal.SIGKILL
    assert job.world.size == 3 and job.world.generation == 1
    t = audit(job)
    assert {r["size"] for r in t.starts(1).values()} == {3}
    assert_resumed_from_commit(t, before=0, after=1)


def hold_at_gate(job: LocalJob, step: int | None = None) -> Path:
    """Hold every member at ``step`` (GATE_STEP when None) while the returned file exists."""
    gate = job.workdir / "gate"
    gate.parent.mkdir(parents=True, exist_ok=True)
    gate.write_text("" if step is None else str(step))
    return gate


LATE_GATE_STEP = 12
"""Where :func:`hold_late` holds: past the step a kill test waits for (6), before the end
of the shortest job here (16 steps)."""


def hold_late(job: LocalJob, step: int = LATE_GATE_STEP) -> Path:
    """Hold every member at ``step`` while the returned file exists. A test that kills a
    member once training reaches step 6 then finds it still training however late it acts
    (a loaded machine can stall the test for longer than the whole job takes); remove the
    file right after the kill."""
    return hold_at_gate(job, step)


@BOTH_BACKENDS
def test_scale_two_to_four_newcomers_get_state_by_broadcast(job: LocalJob) -> None:
    gate = hold_at_gate(job)
    job.start(2)
    wait_for_step(job, GATE_STEP)
    job.scale(4)
    wait_until(job, "the newcomers to be ready and added", lambda: job.world.size == 4)
    gate.unlink()
    finish(job)

    assert job.world.size == 4
    t = audit(job)
    newcomers = set(t.starts(1)) - set(t.starts(0))
    assert len(newcomers) == 2
    # A planned change: no rollback, the new world starts where the old one committed.
    assert_resumed_from_commit(t, before=0, after=1)
    assert_no_rollback(t)


def test_planned_scale_down_leaver_exits_zero_without_rollback(job: LocalJob) -> None:
    gate = hold_at_gate(job)
    job.start(4)
    wait_for_step(job, GATE_STEP)
    leaver = job.world.members[-1].pod
    job.scale(3)
    gate.unlink()
    codes = finish(job)

    assert codes[leaver] == 0
    assert "leaving the job cleanly" in job.log_path(leaver).read_text()
    t = audit(job)
    assert_resumed_from_commit(t, before=0, after=1)
    assert_no_rollback(t)


def assert_none_restarted(job: LocalJob, pods: set[str]) -> None:
    """No member of ``pods`` crashed. Under Horovod too: the Horovod that
    scripts/build_horovod.sh builds stops its loop after a failed collective, so gloo's
    transport no longer ends a survivor of a peer's death (docs/elasticity.md)."""
    for pod in sorted(pods):
        assert not job.pod(pod).restarts, f"{pod} crashed\n{job.log_path(pod).read_text()[-3000:]}"


@BOTH_BACKENDS
def test_kill_rank_zero_the_store_host(job: LocalJob) -> None:
    # Worker pods have restartPolicy OnFailure: the kubelet restarts the killed store
    # host, which rejoins as a newcomer; meanwhile the survivors train on without it.
    # The restarted process holds in its start-up until they have (a forked process can
    # be back before the world without it forms, and is then rightly taken into it).
    job.restart = True
    start_gate = job.workdir / "start-gate"
    job.env["START_GATE_FILE"] = str(start_gate)
    gate = hold_late(job)
    job.start(4)
    wait_for_step(job, 6)
    store_host = job.world.members[0]
    survivors = {m.pod for m in job.world.members[1:]}
    assert job.world.store.address == store_host.ip
    start_gate.touch()
    job.kill(store_host.pod, signal.SIGKILL)
    # Generation 1 is the world without it; a later one with it is its rejoin.
    wait_until(job, "the survivors to train without it",
               lambda: set(traces(job).starts(1)) == survivors)
    start_gate.unlink()
    wait_until(job, "the restarted store host to rejoin", lambda: job.world.generation >= 2
               and job.world.size == 4 and job.world.member(store_host.pod) is not None)
    gate.unlink()
    finish(job)

    assert job.pod(store_host.pod).restarts == 1
    assert_none_restarted(job, survivors)
    # The store moved to a survivor and stayed there: a rejoining pod comes last.
    assert job.world.store.address != store_host.ip
    t = audit(job)
    after = min(g for g in t.generations() if g > 0)
    assert store_host.pod not in t.starts(after)
    assert_resumed_from_last_commit(t, after=after)


def test_two_kills_in_a_row_while_rebuilding(job: LocalJob) -> None:
    job.start(4)
    wait_for_step(job, 6)
    # Rank 0 hosts the next world's store too; frozen, it holds that world in formation.
    first = job.world
    store_host = first.members[0].pod
    survivors = {m.pod for m in first.members[2:]}
    job.kill(store_host, signal.SIGSTOP)
    job.kill(first.members[1].pod, signal.SIGKILL)
    wait_until(job, "the operator's next world", lambda: job.world.generation == 1)
    assert job.world.members[0].pod == store_host
    wait_until(job, "the survivors to leave world 0", lambda: survivors <= {
        pod for pod, r in traces(job).events("interrupted") if r["generation"] == 0})
    # The store host of the world being formed dies before anyone trained in it.
    assert traces(job).starts(1) == {}
    job.kill(store_host, signal.SIGKILL)
    finish(job)

    assert job.world.size == 2 and job.world.generation == 2
    t = audit(job)
    assert t.starts(1) == {}, "world 1 trained: the second kill did not hit it while forming"
    assert t.generations() == [0, 2]
    assert_resumed_from_commit(t, before=0, after=2)


JOIN_GATE_STEP = 20
"""The survivors hold after this step (at a commit) until the test lets them go on."""


@pytest.mark.parametrize("how", ["replaced", "restarted"])
def test_members_train_on_while_a_newcomer_starts_then_switch_at_a_commit(
        tmp_path: Path, how: str) -> None:
    """A newcomer held in its start-up (as by a slow import or image pull) is added only
    once it said it is ready to take part: until then the survivors keep training at
    three; then they switch at a commit, without a rollback, and every sample counts once.
    ``replaced``: a new pod takes the killed one's place (the operator's replacement);
    ``restarted``: the killed process is started again in its pod (the kubelet's)."""
    start_gate = tmp_path / "start-gate"
    env = {**worker_env(tmp_path, "torch"), "GATE_STEP": str(JOIN_GATE_STEP),
           "START_GATE_FILE": str(start_gate)}
    gate = tmp_path / "gate"
    gate.touch()
    with LocalJob([sys.executable, str(WORKER)], tmp_path, env=env,
                  restart=how == "restarted") as job:
        job.start(4)
        wait_for_step(job, GATE_STEP)
        start_gate.touch()  # processes started from now on hold in their start-up
        victim = job.world.members[2].pod
        job.kill(victim, signal.SIGKILL)
        if how == "replaced":
            wait_until(job, "the world of three", lambda: job.world.size == 3)
            job.scale(4)
        newcomer = victim if how == "restarted" else f"{job.job.name}-worker-4"
        wait_until(job, "the newcomer's process to start", lambda: any(
            pod == newcomer for pod, _ in traces(job).events("launched")))

        def at_three(t: Traces) -> set[str]:
            return {pod for pod, r in t.events("stepped")
                    if r["size"] == 3 and r["step"] == JOIN_GATE_STEP}

        wait_until(job, f"the survivors to train up to step {JOIN_GATE_STEP} at three",
                   lambda: len(at_three(traces(job))) == 3)
        # All that time the newcomer was starting, and nobody waited for it.
        assert job.world.size == 3 and job.world.member(newcomer) is None
        start_gate.unlink()
        wait_until(job, "the newcomer to be added", lambda: job.world.size == 4)
        gate.unlink()
        finish(job)

    t = audit(job)
    last = job.world.generation
    assert job.world.member(newcomer) is not None and newcomer in t.starts(last)
    trained_at_three = {r["step"] for _, r in t.events("stepped")
                        if r["generation"] == last - 1}
    assert len(trained_at_three) >= JOIN_GATE_STEP - GATE_STEP - 4, sorted(trained_at_three)
    # The join was planned: the world of four began at the survivors' last commit in
    # the world of three, and the only rollback is the kill's.
    assert_resumed_from_commit(t, before=last - 1, after=last)
    assert t.starts(last)[newcomer]["step"] == JOIN_GATE_STEP
    assert [r.generation for r in t.rollbacks()] == [last - 1]
