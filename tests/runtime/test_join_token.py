"""The join token keeps processes outside the job from claiming a rank, on real processes.

Two intruders reach the store of a two-member world before its members do and ask
for rank 1: one with no token, one with another job's token. The job's own members
still form the group and all-reduce; the intruders are refused at the join barrier.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ringwright.runtime.local.launcher import free_port, write_token
from ringwright.runtime.membership.file_source import write_world_file
from ringwright.world import Env, JobRef, Member, StoreAddress, World
from tests.waiting import wait_for

WORKER = Path(__file__).with_name("join_worker.py")

pytestmark = pytest.mark.timeout(300)


def start(tmp_path: Path, name: str, rank: int, token: str | None,
          deadline_s: float) -> tuple[Path, subprocess.Popen[bytes]]:
    out = tmp_path / f"{name}.out"
    env = {**os.environ, "WORLD_FILE": str(tmp_path / "world.json"), "RANK": str(rank),
           "OUT": str(out), "DEADLINE_S": str(deadline_s), "OMP_NUM_THREADS": "1",
           "TORCH_CPP_LOG_LEVEL": "ERROR"}
    env.pop(Env.JOIN_TOKEN_FILE, None)
    if token is not None:
        token_file = tmp_path / f"{name}.token"
        write_token(token_file, token)
        env[Env.JOIN_TOKEN_FILE] = str(token_file)
    return out, subprocess.Popen([sys.executable, str(WORKER)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def listening(address: str, port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex((address, port)) == 0


def test_a_process_without_the_jobs_token_cannot_claim_a_rank(tmp_path: Path) -> None:
    members = (Member(rank=0, pod="w-0", ip="127.0.0.81"),
               Member(rank=1, pod="w-1", ip="127.0.0.82"))
    world = World(job=JobRef(namespace="t", name="join"), generation=0, members=members,
                  store=StoreAddress(address=members[0].ip, port=free_port()))
    write_world_file(tmp_path / "world.json", world)
    token = "the-jobs-own-token"
    # Rank 0 hosts the store; the intruders ask for rank 1 while the real rank 1 is
    # not there yet, and give up after a while.
    rank0 = start(tmp_path, "rank0", 0, token, deadline_s=120)
    wait_for(lambda: listening(world.store.address, world.store.port), timeout=120,
               what="rank 0 hosts the store")
    intruders = [start(tmp_path, "no-token", 1, None, deadline_s=8),
                 start(tmp_path, "other-job", 1, "another-jobs-token", deadline_s=8)]
    for _, proc in intruders:
        log, _ = proc.communicate(timeout=240)
        assert proc.returncode == 3, log.decode()[-3000:]
        assert "only 1 of 2 members arrived" in log.decode()
    rank1 = start(tmp_path, "rank1", 1, token, deadline_s=120)
    for out, proc in (rank0, rank1):
        log, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, log.decode()[-3000:]
        assert float(out.read_text()) == 3.0
