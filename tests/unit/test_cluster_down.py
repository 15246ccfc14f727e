"""`Cluster.down` stops the cluster's own components and never a process that took over
one of their recorded pids (pids are reused within minutes on a busy machine, and a
pids file outlives a reboot)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ringwright.devcluster.control_plane import Cluster
from ringwright.procstat import start_ticks

SLEEP = "import time; time.sleep(120)"


@pytest.fixture()
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


def _sleeper(processes: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", SLEEP], start_new_session=True)
    processes.append(proc)
    return proc


def test_down_stops_the_clusters_components_and_spares_strangers_on_recorded_pids(
        tmp_path: Path, processes: list[subprocess.Popen[bytes]]) -> None:
    cluster = Cluster(root=tmp_path / "cluster")
    cluster.dir.mkdir()
    component, stranger, older = (_sleeper(processes) for _ in range(3))
    started = start_ticks(component.pid)
    assert started is not None
    (cluster.dir / "pids.json").write_text(json.dumps({
        "etcd": [component.pid, started],
        # The pid the API server had, now another process's (it started at another time).
        "kube-apiserver": [stranger.pid, (start_ticks(stranger.pid) or 0) - 1],
        # A record without a start time, from an older version: no proof it is ours.
        "kwok": older.pid,
    }))

    assert not cluster.running()
    cluster.down()

    # down() reaps the component it stopped (a child of ours): its pid is gone.
    assert start_ticks(component.pid) != started, "the component was not stopped"
    assert stranger.poll() is None, "down() signalled a process that reused a recorded pid"
    assert older.poll() is None, "down() signalled a pid it cannot tell is its own"
    assert not (cluster.dir / "pids.json").exists()
