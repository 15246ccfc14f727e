"""Operator + real runtime processes on the local cluster: the members' stats reach the
job's status, sealed by each pod, through the reports ConfigMap: the goodput and the
checkpoint interval that ``intervalSteps: Auto`` chose."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ringwright.devcluster.podhost import PodHost
from ringwright.kube import KubeClient, api_path
from ringwright.runtime.settings import SettingsEnv
from ringwright.world import parse_stats, reports_configmap_name, stats_key
from tests.e2e.test_elastic_job import WORKER, HostThread
from tests.jobs import OperatorProcess, get_status, tj_path, training_job
from tests.waiting import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

MIN_STEPS = 10


@pytest.fixture
def runner(kube: KubeClient, namespace: str, operator: OperatorProcess,
           tmp_path: Path) -> Iterator[HostThread]:
    checkpoint = {"path": str(tmp_path / "ckpt"), "intervalSteps": "Auto",
                  "autoMinSteps": MIN_STEPS, "autoMaxSteps": 100_000}
    kube.create(tj_path(namespace), training_job("goodput", replicas=2, minimum=1,
                                                 gpusPerWorker=0, checkpoint=checkpoint))
    env = {"TRACE_DIR": str(tmp_path / "pods" / "trace"), "EPOCHS": "400", "SAMPLES": "1024",
           "BATCH": "4", "COMMIT_EVERY": "5", "STEP_SLEEP": "0.05", "OMP_NUM_THREADS": "1",
           SettingsEnv.STATS_INTERVAL: "1"}
    host = PodHost(kube, namespace, "goodput", [sys.executable, str(WORKER)], tmp_path / "pods",
                   extra_env=env, readiness_grace=120)
    runner = HostThread(host)
    yield runner
    runner.close()


def test_goodput_and_the_auto_checkpoint_interval_reach_the_status(
        kube: KubeClient, namespace: str, runner: HostThread) -> None:
    def measured() -> dict[str, Any] | None:
        status = get_status(kube, namespace, "goodput")
        interval = status.get("checkpointInterval") or {}
        goodput = status.get("goodput") or {}
        # A write measured: the interval now follows the numbers, not the lower bound.
        # Each pod's stats come on its own clock: the first status may hold one pod's.
        if (interval.get("writeSeconds") is None or not goodput.get("training")
                or len(goodput.get("members", [])) < 2):
            return None
        return status

    status = wait_for(measured, "status.goodput of both pods and a measured checkpoint interval",
                      timeout=300, interval=1.0)
    interval, goodput = status["checkpointInterval"], status["goodput"]
    assert interval["auto"] is True
    assert MIN_STEPS <= interval["steps"] <= 100_000
    assert interval["mtbfSeconds"] > 0
    assert 0 < goodput["training"] <= 1
    assert sum(goodput[p] for p in ("training", "detecting", "reforming", "syncing",
                                    "replaying")) == pytest.approx(1.0, abs=0.01)
    assert set(goodput["members"]) == {"goodput-worker-0", "goodput-worker-1"}
    cm = kube.get(api_path("v1", "configmaps", namespace, reports_configmap_name("goodput")))
    stats = parse_stats(cm["data"][stats_key("goodput-worker-0")])
    assert stats.mac, "sealed with the pod's report key"
    assert stats.steps_timed > 0
