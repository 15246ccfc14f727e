"""The local launcher replaces a worker slow for good, judged from the stats the members
send (real processes on loopback), and drops one when no spare is left."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ringwright.runtime.local.launcher import LocalJob
from ringwright.runtime.settings import SettingsEnv
from ringwright.stragglers import StragglerRule
from tests.runtime.elastic_traces import Traces
from tests.runtime.test_elastic_processes import WORKER, log_tails, worker_env
from tests.waiting import wait_for

SLOW = "local-worker-1"
DEADLINE_S = 240.0


def env(tmp_path: Path) -> dict[str, str]:
    return {**worker_env(tmp_path, "torch"), "EPOCHS": "400", "SAMPLES": "1024",
            "STEP_SLEEP": "0.05", "SLOW_POD": SLOW, "SLOW_FACTOR": "3",
            SettingsEnv.STATS_INTERVAL: "0.5"}


def waited(job: LocalJob, what: str, probe: Callable[[], object]) -> None:
    try:
        wait_for(probe, what, timeout=DEADLINE_S, interval=0.2)
    except AssertionError as err:
        raise AssertionError(f"{err}\n{log_tails(job)}") from None


def trained_without_slow(job: LocalJob, size: int) -> bool:
    world = job.world
    if world.size != size or SLOW in world.pods:
        return False
    trained = Traces.load(job.workdir / "trace").trained(world.generation)
    return set(world.pods) <= trained


@pytest.mark.parametrize(("spares", "size_after"), [(1, 3), (0, 2)], ids=["replaced", "dropped"])
def test_a_worker_slow_for_good_leaves_the_world(tmp_path: Path, spares: int,
                                                 size_after: int) -> None:
    rule = StragglerRule(factor=1.5, window_s=4.0, spares=spares)
    with LocalJob([sys.executable, str(WORKER)], tmp_path, env=env(tmp_path),
                  stragglers=rule) as job:
        job.start(3)
        waited(job, f"a world of {size_after} without {SLOW} that trained",
               lambda: trained_without_slow(job, size_after))
        if spares:
            assert "local-worker-3" in job.world.pods, "a new process took its place"
        waited(job, f"{SLOW} to exit on its own", lambda: job.exit_codes()[SLOW] is not None)
        assert job.exit_codes()[SLOW] == 0, "it left cleanly, as a scale-down leaver does"
