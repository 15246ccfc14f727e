"""Silent failures with real worker processes: frozen, cut off, slow, restarted.

The local launcher plays the operator: it reads the members' reports, drops a member
only when its peers' word is corroborated, restarts a crashed process like a kubelet
when asked to. The workers detect death by heartbeats (failureDetectSeconds = 3)
with a long collective timeout, so every recovery here is the heartbeat's doing.
No assertion depends on how long anything took; waits are on observed progress.
"""

from __future__ import annotations

import http.client
import json
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ringwright.runtime.collectives.group import FENCED_EXIT
from ringwright.runtime.local.launcher import LocalJob, free_port
from ringwright.runtime.local.pods import PodNetwork
from ringwright.runtime.settings import SettingsEnv
from ringwright.world import Env
from tests.conftest import IN_CI
from tests.runtime import netns
from tests.runtime.elastic_traces import Traces, assert_resumed_from_commit
from tests.runtime.test_elastic_processes import (
    EPOCHS,
    SAMPLES,
    WORKER,
    audit,
    finish,
    hold_late,
    log_tails,
    traces,
    wait_for_step,
    wait_until,
)

pytestmark = pytest.mark.timeout(420)

JobFactory = Callable[..., LocalJob]


@pytest.fixture()
def make_job(tmp_path: Path) -> Iterator[JobFactory]:
    """LocalJob factory: ``make_job(restart=..., network=..., **worker_env)``."""
    jobs: list[LocalJob] = []

    def make(*, restart: bool = False, network: PodNetwork | None = None,
             evict_grace_s: float = 60.0, name: str = "job", backend: str = "torch",
             verdict_wait_s: float = 4.0, settle_s: float = 0.3,
             **worker_env: str) -> LocalJob:
        workdir = tmp_path / name
        env = {
            Env.BACKEND: backend,
            "TRACE_DIR": str(workdir / "trace"),
            "EPOCHS": str(EPOCHS),
            "SAMPLES": str(SAMPLES),
            "BATCH": "4",
            "COMMIT_EVERY": "4",
            "STEP_SLEEP": "0.03",
            "TORCH_CPP_LOG_LEVEL": "ERROR",
            "OMP_NUM_THREADS": "1",
            "GATE_FILE": str(workdir / "gate"),
            SettingsEnv.FAILURE_DETECT: "3",
            # Far beyond any wait in these tests: only the heartbeats may find the dead.
            SettingsEnv.COLLECTIVE_TIMEOUT: "600",
            **worker_env,
        }
        job = LocalJob([sys.executable, str(WORKER)], workdir, env=env, restart=restart,
                       network=network, evict_grace_s=evict_grace_s,
                       verdict_wait_s=verdict_wait_s, settle_s=settle_s)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.close()


def rollbacks(job: LocalJob) -> int:
    """``rolled_back`` events in the workers' logs."""
    return sum(job.log_path(p).read_text().count("rolled_back")
               for p in job.exit_codes() if job.log_path(p).exists())


def readiness(ip: str, port: int) -> int | None:
    """HTTP status of the runtime's ``/readyz``; None when nobody answers in time."""
    conn = http.client.HTTPConnection(ip, port, timeout=3)
    try:
        conn.request("GET", "/readyz")
        return conn.getresponse().status
    except OSError:
        return None
    finally:
        conn.close()


def report_of(job: LocalJob, pod: str) -> dict[str, object]:
    report: dict[str, object] = json.loads((job.reports_dir / f"{pod}.json").read_text())
    return report


BOTH_BACKENDS = pytest.mark.parametrize(
    "backend", ["torch", pytest.param("horovod", marks=pytest.mark.horovod)])


@BOTH_BACKENDS
def test_sigstop_one_of_four_is_found_dead_and_fenced_when_it_wakes(
        make_job: JobFactory, backend: str) -> None:
    port = free_port()
    # A settle window this test never sees end: the next world comes because every
    # survivor stopped and waits for it, as the operator publishes it. No eviction kill
    # either: the woken member must end by fencing itself, which the launcher's kill
    # would hide (it did, for a member stuck in the aborted collective).
    job = make_job(backend=backend, settle_s=3600.0, evict_grace_s=3600.0,
                   **{SettingsEnv.READINESS_PORT: str(port)})
    job.start(4)
    wait_for_step(job, 6)
    victim = job.world.members[2].pod
    job.kill(victim, signal.SIGSTOP)
    # Readiness is served by the runtime itself: a frozen process cannot pass it.
    assert readiness(job.world.members[2].ip, port) is None
    assert readiness(job.world.members[1].ip, port) == 200
    wait_until(job, "a world without the frozen member",
               lambda: job.world.generation == 1 and job.world.member(victim) is None)
    # Survivors name the frozen member, and only it, with the heartbeat evidence (a
    # survivor whose collective another's abort broke first may name nobody).
    survivors = [m.pod for m in job.world.members]
    wait_until(job, "every survivor's report", lambda: all(
        (job.reports_dir / f"{pod}.json").exists() for pod in survivors))
    reports = [report_of(job, pod) for pod in survivors]
    assert all(r["generation"] == 0 and r["suspects"] in ([], [victim]) for r in reports), reports
    naming = [r for r in reports if r["suspects"] == [victim]]
    assert naming and all("no heartbeat" in str(r["detail"]) for r in naming), reports
    # Woken up, it is a member of an old generation: it must not train on, but fence itself.
    job.kill(victim, signal.SIGCONT)
    codes = finish(job)
    assert codes[victim] == FENCED_EXIT, log_tails(job)
    t = audit(job)
    assert {r["size"] for r in t.starts(1).values()} == {3}
    assert victim not in t.starts(1)
    assert_resumed_from_commit(t, before=0, after=1)


def test_two_frozen_at_once(make_job: JobFactory) -> None:
    job = make_job(evict_grace_s=1.0)
    job.start(4)
    wait_for_step(job, 6)
    victims = [job.world.members[1].pod, job.world.members[3].pod]
    for v in victims:
        job.kill(v, signal.SIGSTOP)
    codes = finish(job)
    assert job.world.size == 2 and {m.pod for m in job.world.members}.isdisjoint(victims)
    assert all(codes[v] == -signal.SIGKILL for v in victims), "killed once evicted"
    t = audit(job)
    assert_resumed_from_commit(t, before=0, after=job.world.generation)


def test_rank_zero_frozen_the_store_host(make_job: JobFactory) -> None:
    job = make_job(evict_grace_s=1.0)
    job.start(4)
    wait_for_step(job, 6)
    victim = job.world.members[0].pod
    job.kill(victim, signal.SIGSTOP)
    finish(job)
    assert job.world.size == 3 and job.world.member(victim) is None
    audit(job)


def test_a_slow_rank_zero_is_late_not_dead(make_job: JobFactory) -> None:
    """A 30 s pause of rank 0: no rollback, no new generation, the same final parameters."""
    quick = make_job(name="reference", EPOCHS="1")
    slow = make_job(name="paused", EPOCHS="1", PAUSE_RANK="0", PAUSE_STEP="6",
                    PAUSE_SECONDS="30")
    # Side by side: the reference trains while the other job's rank 0 sleeps.
    quick.start(3)
    slow.start(3)
    finish(quick)
    finish(slow)

    t = traces(slow)
    assert [r["seconds"] for _, r in t.events("pause")] == [30.0]
    assert t.generations() == [0] and slow.world.generation == 0
    assert rollbacks(slow) == 0
    assert final_hashes(t) == final_hashes(traces(quick))


@pytest.mark.horovod
def test_bucketed_gradients_under_horovod_train_and_recover_from_a_kill(
        make_job: JobFactory) -> None:
    """Buckets launched from autograd hooks, reduced by Horovod from the runtime's
    communication thread: training completes, a member killed mid-step costs a rollback
    to the commit as with the flat path, and every rank ends with the same parameters."""
    job = make_job(backend="horovod", BUCKET_BYTES="256")  # several buckets per step
    gate = hold_late(job)
    job.start(3)
    wait_for_step(job, 6)
    job.kill(job.world.members[1].pod, signal.SIGKILL)
    gate.unlink()
    finish(job)
    assert job.world.size == 2
    t = audit(job)
    assert_resumed_from_commit(t, before=0, after=job.world.generation)


def final_hashes(t: Traces) -> set[str]:
    return {str(r["hash"]) for _, r in t.events("done")}


def test_a_user_level_all_reduce_while_a_member_is_killed(make_job: JobFactory) -> None:
    job = make_job(USER_ALLREDUCE="1")
    gate = hold_late(job)
    job.start(4)
    wait_for_step(job, 6)
    victim = job.world.members[1].pod
    job.kill(victim, signal.SIGKILL)
    gate.unlink()
    finish(job)
    assert job.world.size == 3
    t = audit(job)
    assert_resumed_from_commit(t, before=0, after=1)


def test_a_process_restarted_in_its_pod_rejoins_as_a_newcomer(make_job: JobFactory) -> None:
    """Dropped like any dead member, it is added back once it reports that it is ready to
    join: the others train on at three meanwhile, then take it in at a commit. (Slow
    heartbeats here: the survivors must learn of the death from their failed collective,
    not from a verdict on the dead process.)"""
    # 30 s: far beyond a restart under load, and the leave marks at the end, which wait up
    # to a third of it for the store of a rank 0 that finished first, stay short.
    job = make_job(restart=True, verdict_wait_s=600, **{SettingsEnv.FAILURE_DETECT: "30"})
    # The others train on while it starts: held at step 20 (a commit) until it is back,
    # they would otherwise finish without it (the hold also keeps the job from ending
    # before the kill lands).
    gate = hold_late(job, step=20)
    # And the restarted process holds in its start-up until they have trained at three: a
    # forked process is back within a tenth of a second, and is then rightly taken in
    # before they start.
    start_gate = job.workdir / "start-gate"
    job.env["START_GATE_FILE"] = str(start_gate)
    job.start(4)
    wait_for_step(job, 6)
    victim = job.world.members[2].pod
    first_pid = job.pod(victim).process.pid
    survivors = {m.pod for m in job.world.members} - {victim}
    start_gate.touch()
    job.kill(victim, signal.SIGKILL)
    wait_until(job, "the survivors to train without it",
               lambda: set(traces(job).starts(1)) == survivors)
    start_gate.unlink()
    wait_until(job, "the restarted process to be back", lambda: job.world.size == 4
               and job.world.generation >= 2)
    gate.unlink()
    codes = finish(job)
    assert codes[victim] == 0 and job.pod(victim).process.pid != first_pid
    assert job.world.size == 4 and job.world.member(victim) is not None
    assert "kind=joining" in job.log_path(victim).read_text()
    # Every survivor's collective failed at once, also where the killed member was not a
    # ring neighbour: the first to fail aborted its group for the others. No survivor
    # waited for the (30 s) heartbeat verdict.
    assert not any("peers_dead" in job.log_path(p).read_text() for p in codes), \
        log_tails(job)
    t = audit(job)
    # The restarted process trained again, with the state it received from a survivor,
    # which trained at three until it was ready.
    pids = {r["pid"] for pod, r in t.events("start") if pod == victim}
    assert len(pids) == 2
    last = job.world.generation
    assert {r["size"] for r in t.starts(last - 1).values()} == {3}
    assert_resumed_from_commit(t, before=last - 1, after=last)


def test_rank_zero_dies_during_the_state_broadcast_of_a_new_generation(
        make_job: JobFactory) -> None:
    """A newcomer holds no state, so the generation it joins starts with rank 0 broadcasting
    its state; rank 0 is killed once that broadcast has begun. The rest roll back,
    re-form without it and one of the old members sends the state instead."""
    # Slow steps: training must outlast the newcomer's start-up.
    job = make_job(BALLAST_MB="96", STEP_SLEEP="1.0")
    job.start(3)
    wait_for_step(job, 4)
    source = job.world.members[0].pod
    job.scale(4)
    log = job.log_path(source)
    wait_until(job, "rank 0 starting the state broadcast of generation 1",
               lambda: "sync_started generation=1 rank=0 source_rank=0" in log.read_text())
    job.kill(source, signal.SIGKILL)
    finish(job)
    assert job.world.size == 3 and job.world.member(source) is None
    survivors = [m.pod for m in job.world.members]
    # Nobody finished the broadcast: every receiver saw it fail.
    assert all("sync_failed generation=1" in job.log_path(p).read_text() for p in survivors), \
        log_tails(job)
    assert "world_ready generation=1" not in log.read_text()
    t = audit(job)
    assert_resumed_from_commit(t, before=0, after=job.world.generation)


@pytest.mark.horovod
def test_a_member_dead_inside_horovods_rendezvous_costs_a_restart_not_a_timeout(
        make_job: JobFactory, tmp_path: Path) -> None:
    """A newcomer freezes inside ``hvd.init()``, after the join barrier: the others are
    blocked in Horovod's own rendezvous, where nothing can interrupt them. They find it
    dead by its heartbeats, one of them checkpoints the last commit, all exit and are
    restarted, and the world re-forms without it from that checkpoint, instead of
    waiting out Horovod's timeout (600 s here)."""
    victim = "local-worker-3"
    job = make_job(backend="horovod", restart=True, evict_grace_s=1.0,
                   FREEZE_IN_HVD_INIT=victim, CHECKPOINT_DIR=str(tmp_path / "checkpoints"),
                   STEP_SLEEP="0.5")
    # Held before the commit of step 8 until the newcomer is in the world: the others
    # cannot finish the job before it starts, however slowly it imports torch.
    gate = hold_late(job, step=8)
    job.start(3)
    wait_for_step(job, 8)
    job.scale(4)
    # Members train on while a newcomer starts (it enters a world once it reported
    # `joining`): without the gate they could finish before it imported torch.
    wait_until(job, "the newcomer in the world", lambda: job.world.member(victim) is not None)
    gate.unlink()
    finish(job)
    assert job.world.size == 3 and job.world.member(victim) is None
    survivors = [m.pod for m in job.world.members]
    for pod in survivors:
        assert f"init_abandoned pod={pod}" in job.log_path(pod).read_text(), log_tails(job)
    t = audit(job)
    assert all(len({r["pid"] for p, r in t.events("start") if p == pod}) == 2
               for pod in survivors), "each survivor trained in a second, restarted process"
    assert_resumed_from_commit(t, before=0, after=job.world.generation)


@pytest.fixture()
def namespaces() -> Iterator[netns.NamespacedPods]:
    reason = netns.available()
    if reason is not None:
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    pods = netns.NamespacedPods()
    try:
        yield pods
    finally:
        pods.close()


@pytest.mark.parametrize(
    "backend", ["torch", pytest.param("horovod", marks=pytest.mark.horovod)])
def test_a_member_cut_off_from_its_peers_leaves_and_the_rest_continue(
        make_job: JobFactory, namespaces: netns.NamespacedPods, backend: str) -> None:
    job = make_job(network=namespaces, backend=backend)
    job.start(4)
    wait_for_step(job, 6)
    victim = job.world.members[3]
    namespaces.cut(victim.rank)
    codes = finish(job)
    assert job.world.size == 3 and job.world.member(victim.pod) is None
    # Cut off, it found everyone silent, was not believed, and fenced itself.
    assert codes[victim.pod] == FENCED_EXIT, log_tails(job)
    t = audit(job)
    assert victim.pod not in t.starts(job.world.generation)
    assert_resumed_from_commit(t, before=0, after=job.world.generation)
