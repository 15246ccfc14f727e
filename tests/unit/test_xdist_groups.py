"""The xdist groups really reach the scheduler: a small suite run with ``-n 4``.

Cluster tests must all land on one worker, the real-node tests on one other, and
real-process tests on at most ``PROCESS_LANES`` workers, each lane on one. pytest 9.2
silently stopped honouring xdist 3.8's groups once; this catches that kind of change.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

from tests.xdist_groups import PROCESS_LANES, UNGROUPED, lane_seconds

ROOT = Path(__file__).resolve().parents[2]

CONFTEST = '''
import os

import pytest
from tests.xdist_groups import assign_groups

@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    assign_groups(items, loadgroup=bool(getattr(config.option, "loadgroup", False)))

@pytest.fixture
def cluster():
    return None

@pytest.fixture
def kube(cluster):
    return None

@pytest.fixture(autouse=True)
def _where(request):
    with open(os.environ["WHERE"], "a") as f:
        f.write(f"{request.node.name} {request.node.path.parent.name} "
                f"{os.environ['PYTEST_XDIST_WORKER']}\\n")
'''

TESTS = '''
import pytest

@pytest.mark.parametrize("i", range(6))
def test_{kind}(i, {fixture}):
    pass
'''


def test_cluster_tests_share_one_worker_and_process_tests_keep_to_their_lanes(
        tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    (suite / "tests" / "cluster").mkdir(parents=True)
    (suite / "tests" / "realnode").mkdir()
    (suite / "tests" / "runtime").mkdir()
    (suite / "tests" / "unit").mkdir()
    (suite / "pytest.ini").write_text("[pytest]\n")
    (suite / "conftest.py").write_text(CONFTEST)
    (suite / "tests" / "cluster" / "test_c.py").write_text(
        TESTS.format(kind="c", fixture="kube"))
    (suite / "tests" / "realnode" / "test_r.py").write_text(
        TESTS.format(kind="r", fixture="kube"))
    (suite / "tests" / "runtime" / "test_p.py").write_text(
        TESTS.format(kind="p", fixture="tmp_path"))
    (suite / "tests" / "unit" / "test_u.py").write_text(
        TESTS.format(kind="u", fixture="tmp_path"))
    # Only xdist among the plugins: the run stays cheap on a loaded machine.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WHERE": str(tmp_path / "where"),
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "xdist", "-p", "no:cacheprovider",
         "-n", "4",
         "--dist", "loadgroup", "--basetemp", str(tmp_path / "base"), "tests"],
        cwd=suite, env=env, capture_output=True, text=True, timeout=500)
    assert run.returncode == 0, run.stdout + run.stderr

    workers: dict[str, set[str]] = defaultdict(set)
    lanes: dict[str, set[str]] = defaultdict(set)
    for line in (tmp_path / "where").read_text().splitlines():
        name, folder, worker = line.split()
        workers[folder].add(worker)
        if folder == "runtime":
            lanes[worker].add(name)
    assert len(workers["cluster"]) == 1, workers
    # The real-node tests: one worker too, not the cluster tests' (a control plane each).
    assert len(workers["realnode"]) == 1 and workers["realnode"] != workers["cluster"], workers
    assert 1 < len(workers["runtime"]) <= PROCESS_LANES, workers
    # Dealt in turn: each lane holds half of the process tests.
    assert sorted(len(names) for names in lanes.values()) == [3, 3], lanes


def test_lane_seconds_sum_every_phase_by_the_group_suffix() -> None:
    def report(nodeid: str, when: str, duration: float) -> SimpleNamespace:
        return SimpleNamespace(nodeid=nodeid, when=when, duration=duration)

    reports = [report("tests/e2e/test_demo.py::test_demo@cluster", "setup", 30.0),
               report("tests/e2e/test_demo.py::test_demo@cluster", "call", 40.0),
               report("tests/runtime/t.py::test_x[a@b]@processes-1", "call", 5.0),
               report("tests/runtime/t.py::test_x[a@b]@processes-1", "teardown", 0.5),
               report("tests/unit/t.py::test_y[a@b]", "call", 1.0),
               report("tests/unit/t.py::test_z", "call", 2.0),
               SimpleNamespace(nodeid="tests/unit/t.py", duration=9.0)]  # a collect report
    assert lane_seconds(reports) == {"cluster": 70.0, "processes-1": 5.5, UNGROUPED: 3.0}
