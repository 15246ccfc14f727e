"""Elastic PS-mode jobs on real processes: workers killed, servers killed, resizes.

The test plays the operator: it rewrites the world file when a pod dies or the job
is resized. Accounting is read from the data-shard service's final log line.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ringwright.runtime.ps.env import PSEnv
from ringwright.runtime.ps.wire.transport import Stub
from tests.ps.harness import LocalPSJob, consistency, ps_done

SAMPLES = 3072
ARGS = ["--samples", str(SAMPLES), "--vocab", "300", "--dim", "4", "--batch-size", "32",
        "--piece-batches", "4", "--epochs", "2", "--optimizer", "adagrad"]
ASYNC = consistency("Async", tau=16)
"""The job spec's consistency (spec.ps), as the operator passes it."""


@pytest.fixture
def make_job(tmp_path: Path) -> Iterator[type[LocalPSJob]]:
    jobs: list[LocalPSJob] = []

    def make(servers: int, args: list[str] = ARGS, env: dict[str, str] = ASYNC) -> LocalPSJob:
        job = LocalPSJob(tmp_path, servers, args, env)
        jobs.append(job)
        return job

    yield make  # type: ignore[misc]
    for job in jobs:
        job.close()


def _accounting(job: LocalPSJob, pod: str) -> dict[str, dict[int, int]]:
    return ps_done((job.root / f"{pod}.log").read_text())


def _exact(counts: dict[str, dict[int, int]], epochs: int = 2) -> None:
    for epoch in range(epochs):
        got = counts["trained"].get(epoch, 0) + counts["dropped"].get(epoch, 0)
        assert got == SAMPLES, f"epoch {epoch}: {counts}"


def test_killed_worker_pieces_are_requeued_with_exact_accounting(make_job) -> None:  # type: ignore[no-untyped-def]
    job: LocalPSJob = make_job(2)
    # w1 slow: the kill lands inside its first piece (steps 1-4), not between two pieces.
    job.start_all(["w0", "w1", "w2"], extra={"w1": ["--slow", "0.2"]})
    job.wait_steps("w1", 2)
    job.kill("w1")
    job.publish(["w0", "w2"])  # the operator drops the dead pod from the world
    codes = job.wait_all()
    assert codes["w0"] == codes["w2"] == codes["ps-0"] == codes["ps-1"] == 0, job.logs()
    counts = _accounting(job, "ps-0")
    _exact(counts)
    assert sum(counts["requeued"].values()) > 0, counts


def test_scale_workers_2_to_6_to_3(make_job) -> None:  # type: ignore[no-untyped-def]
    job: LocalPSJob = make_job(2, [*ARGS, "--slow", "0.02"])
    grown = [f"w{i}" for i in range(6)]
    # Newcomers' processes start early and wait for a world that lists them, as pods
    # that are Running but not yet members would.
    job.start_all(["w0", "w1"])
    for w in grown[2:]:
        job.start(w, "worker")
    job.wait_steps("w0", 5)
    job.publish(grown)
    for w in grown[2:]:
        job.wait_steps(w, 3)
    job.publish(grown[:3])
    codes = job.wait_all()
    assert all(c == 0 for c in codes.values()), job.logs()
    for w in grown[3:]:
        assert job.result(w)["left"] is True
    assert all(job.steps(w) for w in grown)  # every worker trained
    _exact(_accounting(job, "ps-0"))


def test_killed_ps_fails_over_to_its_replica_and_is_reseeded(make_job, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Slow enough that the replacement comes up while the job still trains.
    args = [*ARGS, "--slow", "0.1"]
    args[args.index("--epochs") + 1] = "4"
    # Checkpoints on: the replacement must still take the live copy, not the older
    # checkpoint.
    job: LocalPSJob = make_job(2, args, {**ASYNC, PSEnv.CHECKPOINT_DIR: str(tmp_path / "ck"),
                                         PSEnv.CHECKPOINT_VERSIONS: "4"})
    job.start_all(["w0", "w1"])
    job.wait_steps("w0", 10)
    before = len(job.steps("w0"))
    job.kill("ps-0")  # holds shard 0 and the data-shard service
    job.wait_steps("w0", before + 10)
    # The operator brings a replacement at a new address; the survivor re-seeds it.
    ips = dict(job.ps_ip)
    ips["ps-0"] = ips["ps-0"].rsplit(".", 1)[0] + ".9"
    job.publish(ps=ips)
    job.start("ps-0", "ps")
    stub = Stub(f"{ips['ps-0']}:{job.port}")
    try:
        deadline = time.monotonic() + 60
        roles: dict[str, str] = {}
        while time.monotonic() < deadline:
            try:
                status, _ = stub.call("Status", {}, timeout=2.0)
                roles = {k: v["role"] for k, v in status["shards"].items()}
            except Exception:  # not up yet
                roles = {}
            if roles == {"0": "replica", "1": "replica"}:
                break
            time.sleep(0.2)
        assert roles == {"0": "replica", "1": "replica"}, roles
    finally:
        stub.close()
    codes = job.wait_all()
    assert codes["w0"] == codes["w1"] == codes["ps-1"] == 0, job.logs()
    assert "ps_restored" not in (job.root / "ps-0.log").read_text(), job.logs()
    # One worker promotes the replica; the other promotes it too or finds it promoted.
    logs = [(job.root / f"{w}.log").read_text() for w in ("w0", "w1")]
    assert any("ps_failover shard=0 to=1" in log for log in logs), job.logs()
    assert all("ps_failover shard=0 to=1" in log or "ps_rerouted shard=0 to=1" in log
               for log in logs), job.logs()
    # Every change of the data queue reached the replica before it was answered:
    # nothing lost, nothing trained twice, by the queue's count and by the workers' own
    # (which includes batches whose report was refused).
    _exact(_accounting(job, "ps-1"), epochs=4)
    for epoch in range(4):
        steps = [s for w in ("w0", "w1") for s in job.steps(w) if s["epoch"] == epoch]
        assert sum(s["samples"] for s in steps) == SAMPLES, (epoch, job.logs())


def test_async_straggler_pushes_beyond_tau_are_dropped_and_counted(make_job) -> None:  # type: ignore[no-untyped-def]
    args = [*ARGS]
    args[args.index("--epochs") + 1] = "1"
    job: LocalPSJob = make_job(1, args, consistency("Async", tau=2))
    job.start_all(["fast", "slow"], extra={"slow": ["--slow", "0.05"]})
    codes = job.wait_all()
    assert all(c == 0 for c in codes.values()), job.logs()
    counts = ps_done((job.root / "ps-0.log").read_text())
    dropped_pushes = job.result("fast")["dropped"] + job.result("slow")["dropped"]
    assert job.result("slow")["dropped"] > 0
    # Every dropped push is one whole batch; the server and the workers agree.
    assert counts["dropped"][0] == dropped_pushes * 32
    assert counts["trained"][0] + counts["dropped"][0] == SAMPLES
    traced = job.steps("fast") + job.steps("slow")
    assert all(s["staleness"] > 2 for s in traced if s["dropped"])
    assert all(s["staleness"] <= 2 for s in traced if not s["dropped"])
    assert max(counts["staleness"]) <= 2  # applied pushes only


def test_a_frozen_ps_is_failed_over_and_the_job_ends_exact(make_job) -> None:  # type: ignore[no-untyped-def]
    # ps-1 holds shard 1 and the replica of shard 0 (and of the data service). Frozen for
    # longer than the workers' probe, it is failed over; thawed, it steps down and is
    # re-seeded. No sample is trained twice or lost meanwhile.
    args = [*ARGS, "--slow", "0.03"]
    job: LocalPSJob = make_job(2, args)
    job.start_all(["w0", "w1"])
    job.wait_steps("w0", 10)
    frozen = job.procs["ps-1"]
    frozen.send_signal(signal.SIGSTOP)
    try:
        before = len(job.steps("w0"))
        job.wait_steps("w0", before + 20)  # training goes on without it
    finally:
        frozen.send_signal(signal.SIGCONT)
    codes = job.wait_all()
    assert codes["w0"] == codes["w1"] == codes["ps-0"] == 0, job.logs()
    # Found by its unanswered pings, long before the calls' deadline would have.
    logs = "".join((job.root / f"{w}.log").read_text() for w in ("w0", "w1"))
    assert "ps_failover shard=1 to=0" in logs and "cause=UNAVAILABLE" in logs, job.logs()
    assert "cause=DEADLINE_EXCEEDED" not in logs, job.logs()
    _exact(_accounting(job, "ps-0"))
    for epoch in range(2):
        steps = [s for w in ("w0", "w1") for s in job.steps(w) if s["epoch"] == epoch]
        assert sum(s["samples"] for s in steps) == SAMPLES, (epoch, job.logs())


def test_a_job_that_lost_every_server_goes_on_from_its_checkpoints(make_job, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {**ASYNC, PSEnv.CHECKPOINT_DIR: str(tmp_path / "checkpoints"),
           PSEnv.CHECKPOINT_VERSIONS: "8"}
    args = [*ARGS, "--slow", "0.03"]
    job: LocalPSJob = make_job(2, args, env)
    job.start_all(["w0", "w1"])
    job.wait_steps("w0", 30)
    for pod in list(job.procs):  # every pod lost at once (or the job suspended)
        job.kill(pod)
    restarted = time.time()
    job.start_all(["w0", "w1"])  # the operator creates the pods again
    codes = job.wait_all()
    assert all(code == 0 for code in codes.values()), job.logs()
    restored = re.findall(r"ps_restored shard=(\d) version=(\d+)",
                          "".join((job.root / f"{p}.log").read_text() for p in job.ps))
    assert sorted(shard for shard, _ in restored) == ["0", "1"], job.logs()
    assert all(int(version) >= 8 for _, version in restored), restored
    # The data queue came back with shard 0: the restarted job trained what the
    # checkpoint had not, each sample of each epoch once by the queue's count.
    _exact(_accounting(job, "ps-0"))
    after = [s for w in ("w0", "w1") for s in job.steps(w) if s["t"] > restarted]
    assert 0 < sum(s["samples"] for s in after) < 2 * SAMPLES, job.logs()
