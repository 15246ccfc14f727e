"""The pod entry point's pure part: each local rank's environment and the pod's status."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from ringwright.runtime.launch import (
    LaunchError,
    PodRanks,
    exit_status,
    local_env,
    local_rank_from_env,
)
from ringwright.world import Env

POD = {Env.POD_NAME: "tj-worker-0", Env.READINESS_PORT: "29401", Env.METRICS_PORT: "9401",
       Env.HEALTH_FILE: "/tmp/ringwright/healthy"}


def test_each_local_rank_gets_one_gpu_and_rank_zero_keeps_the_pods_ports() -> None:
    envs = [local_env(POD, k, 3) for k in range(3)]
    assert [(e[Env.LOCAL_RANK], e[Env.LOCAL_WORLD_SIZE], e["CUDA_VISIBLE_DEVICES"])
            for e in envs] == [("0", "3", "0"), ("1", "3", "1"), ("2", "3", "2")]
    assert (envs[0][Env.READINESS_PORT], envs[0][Env.METRICS_PORT]) == ("29401", "9401")
    assert envs[0][Env.HEALTH_FILE] == "/tmp/ringwright/healthy"
    assert all((e[Env.READINESS_PORT], e[Env.METRICS_PORT]) == ("0", "0") for e in envs[1:])
    assert envs[2][Env.HEALTH_FILE] == "/tmp/ringwright/healthy.2"
    assert all(local_rank_from_env(e) == k for k, e in enumerate(envs))


def test_a_listed_set_of_gpus_is_dealt_in_order() -> None:
    pod = {**POD, "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert [local_env(pod, k, 4)["CUDA_VISIBLE_DEVICES"] for k in range(4)] == list("4567")
    with pytest.raises(LaunchError, match="lists 4 GPUs for 8 local ranks"):
        local_env({**pod}, 0, 8)


def test_a_process_of_a_multi_rank_pod_not_started_by_the_entry_point_is_refused() -> None:
    with pytest.raises(ValueError, match="entry point did not start this process"):
        local_rank_from_env({Env.PROCS_PER_POD: "8"})
    assert local_rank_from_env({Env.PROCS_PER_POD: "1"}) == 0
    assert local_rank_from_env({Env.LOCAL_RANK: "5"}) == 0  # someone else's LOCAL_RANK


def test_exit_status_reads_like_a_shell() -> None:
    assert exit_status(-signal.SIGKILL) == 137
    assert (exit_status(0), exit_status(75)) == (0, 75)


def run_ranks(script: str, procs: int = 3) -> int:
    ranks = PodRanks([sys.executable, "-c", script], {"PATH": "/usr/bin:/bin"}, procs,
                     poll_s=0.01)
    ranks.start()
    return ranks.wait()


def test_every_rank_done_is_a_pod_done() -> None:
    assert run_ranks("pass") == 0


def test_one_failed_rank_stops_the_others_and_gives_its_status() -> None:
    # Rank 1 fails at once; ranks 0 and 2 would run for ten minutes.
    script = ("import os, sys, time\n"
              "if os.environ['LOCAL_RANK'] == '1': sys.exit(75)\n"
              "time.sleep(600)\n")
    assert run_ranks(script) == 75


def test_horovod_sees_a_pod_as_one_host() -> None:
    from ringwright.runtime.collectives.horovod_backend import horovod_env
    from ringwright.world import JobRef, Member, StoreAddress, World

    members = tuple(Member(rank=i, pod=f"p{i // 3}", local_rank=i % 3, ip="10.0.0.1")
                    for i in range(6))
    world = World(job=JobRef(namespace="n", name="j"), generation=0, members=members,
                  store=StoreAddress(address="10.0.0.1"))
    env = horovod_env(world, 4, "10.0.0.1", 29400, 30)
    assert (env["HOROVOD_RANK"], env["HOROVOD_SIZE"]) == ("4", "6")
    assert (env["HOROVOD_LOCAL_RANK"], env["HOROVOD_LOCAL_SIZE"]) == ("1", "3")
    assert (env["HOROVOD_CROSS_RANK"], env["HOROVOD_CROSS_SIZE"]) == ("1", "2")
    assert env["HOROVOD_HOSTNAME"] == "p1"


def test_sigterm_reaches_every_rank_and_none_is_cut_short(tmp_path: Path) -> None:
    # Each rank takes a while to "checkpoint" after SIGTERM; rank 0, quickest, exits 143.
    # The pod waits for all of them instead of killing the others as after a crash.
    script = ("import os, signal, sys, time, pathlib\n"
              "k = int(os.environ['LOCAL_RANK'])\n"
              f"out = pathlib.Path({str(tmp_path)!r})\n"
              "def stop(signum, frame):\n"
              "    time.sleep(0.2 * k)\n"
              "    (out / str(k)).write_text('flushed')\n"
              "    sys.exit(143 if k == 0 else 0)\n"
              "signal.signal(signal.SIGTERM, stop)\n"
              "(out / f'ready{k}').touch()\n"
              "time.sleep(600)\n")
    ranks = PodRanks([sys.executable, "-c", script], {"PATH": "/usr/bin:/bin"}, 3,
                     poll_s=0.01)
    ranks.start()
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{k}").exists() for k in range(3)):
        assert time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.01)
    ranks.stop(signal.SIGTERM)
    assert ranks.wait() == 143
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("ready")) == [
        "0", "1", "2"]
