"""The demo's driver, end to end on the test suite's cluster and operator.

It applies the example job, deletes a worker's pod mid-training and waits for the
smaller world and the replacement's rejoin, reading the job's status only once it
shows the epoch awaited. Then the metrics of the training processes and of the
operator, parsed with prometheus_client's parser, must show the failure as a recovery
and new epochs, and the timeline must be a PNG.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ringwright.devcluster.control_plane import Cluster
from ringwright.devcluster.demo import run_job
from ringwright.kube import KubeClient
from ringwright.operator.metrics import LossCause
from ringwright.world import ReportKind
from tests.jobs import OperatorProcess

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.timeout(900)]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FAILED = ReportKind.COLLECTIVE_FAILED.value


def test_demo_survives_a_deleted_pod_and_draws_its_timeline(
    cluster: Cluster, kube: KubeClient, namespace: str, operator: OperatorProcess,
    tmp_path: Path,
) -> None:
    run = run_job(cluster, kube, tmp_path, namespace=namespace, operator_log=operator.log,
                  operator_metrics=operator.metrics_url)

    first, shrunk, healed = run.epochs
    assert first < shrunk <= healed
    assert run.png.read_bytes()[:8] == PNG_MAGIC
    assert len(run.runtime) == 4, f"metrics of every training process: {sorted(run.runtime)}"
    survivors = [pod for pod, got in run.runtime.items()
                 if got.get("ringwright_runtime_recoveries_total", cause=FAILED)]
    assert len(survivors) >= 2, "the survivors count the failure as a recovery"
    for pod in survivors:
        got = run.runtime[pod]
        assert got.get("ringwright_runtime_rollbacks_total") >= 1
        assert got.get("ringwright_runtime_recovery_seconds_count",
                       cause=FAILED) >= 1
    for pod, got in run.runtime.items():
        assert got.get("ringwright_runtime_world_epoch") >= healed, pod
        assert got.get("ringwright_runtime_world_size") == 4, pod
        assert got.get("ringwright_runtime_step_seconds_count") > 0, pod
    assert run.operator is not None
    assert run.operator.get("ringwright_operator_members_lost_total", cause=LossCause.POD_GONE) >= 1
    assert run.operator.get("ringwright_operator_world_epochs_published_total") >= healed
    assert run.operator.get("ringwright_operator_pods_created_total", role="worker") >= 5
