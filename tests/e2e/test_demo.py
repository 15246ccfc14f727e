"""The demo's driver, end to end on the test suite's cluster and operator, watched by a
real Prometheus.

The driver applies the example job, cordons the nodes (so the replacement waits),
deletes a worker's pod mid-training and waits for the smaller world, uncordons them and
waits for the replacement's rejoin, reading the job's status only once it
shows the generation awaited. The test reads every world the operator publishes meanwhile:
one at the reduced size must come between the first and the healed one. Prometheus
(built from its Go module like the control plane) scrapes the operator and discovers
the training pods through the API as the chart's PodMonitor would; its query API must
then show the failure as recoveries and the world generation moving on. The driver's own
scrape, parsed with prometheus_client's parser, must agree, and the timeline must be a
PNG.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from ringwright.devcluster.build import ensure_binaries
from ringwright.devcluster.control_plane import Cluster
from ringwright.devcluster.demo import OPERATOR_SETTINGS, run_job
from ringwright.devcluster.example import EXAMPLE
from ringwright.devcluster.prometheus import Prometheus, config
from ringwright.kube import KubeClient
from ringwright.operator.metrics import LossCause
from ringwright.world import ReportKind, World
from tests.cluster.test_faults_cluster import GenerationLog
from tests.jobs import OperatorProcess

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.timeout(900)]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FAILED = ReportKind.COLLECTIVE_FAILED.value


@pytest.fixture()
def demo_operator(cluster: Cluster, operator: OperatorProcess,
                  tmp_path: Path) -> Iterator[OperatorProcess]:
    """The operator as `make demo` runs it, in place of the suite's for this test."""
    operator.stop()
    demo = OperatorProcess(cluster, tmp_path / "operator.log", settings=OPERATOR_SETTINGS)
    demo.start()
    try:
        yield demo
    finally:
        demo.stop()
        operator.start()


@pytest.fixture()
def prometheus(cluster: Cluster, namespace: str, demo_operator: OperatorProcess,
               tmp_path: Path) -> Iterator[Prometheus]:
    binary = ensure_binaries(("prometheus",))["prometheus"]
    prom = Prometheus(binary, tmp_path / "prometheus", config(
        f"127.0.0.1:{demo_operator.metrics_port}", cluster.kubeconfig, [namespace]))
    prom.start()
    yield prom
    prom.stop()


def eventually(what: str, probe: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"prometheus never showed {what}")
        time.sleep(0.5)


def test_demo_survives_a_deleted_pod_and_prometheus_sees_the_recovery(
    cluster: Cluster, kube: KubeClient, namespace: str, demo_operator: OperatorProcess,
    prometheus: Prometheus, tmp_path: Path,
) -> None:
    operator = demo_operator
    ns = f'namespace="{namespace}"'

    # Each world is waited for in Prometheus while its pods run: a replacement's pod is
    # found by service discovery (whose updates leave at most every 5 s) and then
    # scraped, and the job is torn down a few seconds after it joins.
    def scraped_everyone(world: World) -> None:
        eventually(f"all {world.size} members in generation {world.generation}",
                   lambda: prometheus.value(
                       f"count(ringwright_runtime_world_generation{{{ns}}} == {world.generation})")
                   == world.size)

    with GenerationLog(cluster, namespace) as worlds:
        run = run_job(cluster, kube, tmp_path, namespace=namespace, operator_log=operator.log,
                      operator_metrics=operator.metrics_url, before_failure=scraped_everyone,
                      after_recovery=scraped_everyone)

    # The deleted pod left a world of 3 before its replacement made it 4 again.
    first, shrunk, healed = run.generations
    sizes = worlds.sizes(yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"])
    assert first < shrunk < healed, (run.generations, sizes)
    assert (sizes.get(first), sizes.get(shrunk), sizes.get(healed)) == (4, 3, 4), sizes
    assert run.png.read_bytes()[:8] == PNG_MAGIC

    # Through Prometheus' HTTP query API. The pods' processes are gone by now (their
    # series are stale), so the queries look back over the run.
    recovered = f'max_over_time(ringwright_runtime_recoveries_total{{{ns},cause="{FAILED}"}}[15m])'
    eventually("a recovery on each of the 3 survivors",
               lambda: prometheus.value(f"count({recovered} >= 1)") == 3)
    eventually(f"every member in generation {healed}", lambda: prometheus.value(
        f"count(max_over_time(ringwright_runtime_world_generation{{{ns}}}[15m]) >= {healed})") == 4)
    survivors = sorted(labels["pod"] for labels, _ in prometheus.query(f"{recovered} >= 1"))
    moved = {labels["pod"]: value for labels, value in prometheus.query(
        f"max_over_time(ringwright_runtime_world_generation{{{ns}}}[15m])"
        f" - min_over_time(ringwright_runtime_world_generation{{{ns}}}[15m])")}
    assert all(moved[pod] >= healed - first for pod in survivors), (survivors, moved)
    print(f"prometheus: recovered {survivors}, generation moved by {moved}")
    assert (prometheus.value(f'sum(ringwright_operator_members_lost_total{{cause='
                             f'"{LossCause.POD_GONE}"}})') or 0) >= 1

    # The driver's own scrape, parsed with prometheus_client's parser.
    assert len(run.runtime) == 4, f"metrics of every training process: {sorted(run.runtime)}"
    for pod in survivors:
        got = run.runtime[pod]
        assert got.get("ringwright_runtime_recoveries_total", cause=FAILED) >= 1
        assert got.get("ringwright_runtime_rollbacks_total") >= 1
    for pod, got in run.runtime.items():
        assert got.get("ringwright_runtime_world_size") == 4, pod
        assert got.get("ringwright_runtime_step_seconds_count") > 0, pod
    assert run.operator is not None
    assert run.operator.get("ringwright_operator_world_generations_published_total") >= healed
    assert run.operator.get("ringwright_operator_pods_created_total", role="worker") >= 5
