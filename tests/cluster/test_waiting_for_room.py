"""A job that found no room starts as soon as another job's pods give room back, not at
its next resync: the operator here resyncs every ten minutes (as the Kueue tests' does),
so only the wake-up on a freed pod can place the waiting job within the test's wait.

Seen on real nodes before: Kueue admitted a preempted job again while its preemptor's
pods were still terminating; the job found no room, and sat Pending until its resync.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ringwright.devcluster.control_plane import Cluster
from ringwright.kube import KubeClient
from tests.cluster.test_placement_cluster import (
    SLOW,
    bound,
    cluster_facts,
    job,
    pods_of,
    pods_when,
    wait_quiet,
    wait_unschedulable,
)
from tests.jobs import OperatorProcess, instead_of, tj_path
from tests.waiting import wait_for

pytestmark = pytest.mark.cluster

HOSTNAME = "kubernetes.io/hostname"


@pytest.fixture(scope="module")
def slow_resync_operator(cluster: Cluster, operator: OperatorProcess,
                         tmp_path_factory: pytest.TempPathFactory
                         ) -> Iterator[OperatorProcess]:
    """The operator with a ten-minute resync, in place of the session's for this module."""
    own = OperatorProcess(cluster, tmp_path_factory.mktemp("room-op") / "operator.log",
                          settings={**operator.settings, "RINGWRIGHT_RESYNC_SECONDS": "600"},
                          supervised=True)
    with instead_of(operator, own):
        yield own


def test_a_job_waiting_for_room_starts_when_another_jobs_pods_go(
    kube: KubeClient, namespace: str, slow_resync_operator: OperatorProcess
) -> None:
    wait_quiet(kube, namespace)
    node = min(n.name for n in cluster_facts(kube).values() if n.model and n.free_gpus == 8)

    def on_the_node(name: str) -> dict[str, object]:
        manifest = job(name, 1, 8)
        manifest["spec"]["workers"]["template"]["spec"]["nodeSelector"] = {HOSTNAME: node}
        return manifest

    kube.create(tj_path(namespace), on_the_node("first"))
    wait_for(lambda: pods_when(kube, namespace, "first", 1, bound), "first: its pod bound",
             timeout=SLOW)
    kube.create(tj_path(namespace), on_the_node("second"))
    cond = wait_unschedulable(kube, namespace, "second")
    assert cond["reason"] == "InsufficientCapacity", cond
    assert pods_of(kube, namespace, "second") == []

    kube.delete(tj_path(namespace, "first"))
    (placed,) = wait_for(lambda: pods_when(kube, namespace, "second", 1, bound),
                         "second: its pod bound once first's is gone (long before the "
                         "operator's ten-minute resync)", timeout=SLOW)
    assert placed["spec"]["nodeName"] == node
