"""Kueue for the tests that queue jobs through it: the real Kueue (v0.17, built from its
Go module) running for one test module, an operator with the Kueue integration on
instead of the session's meanwhile, and per test a ResourceFlavor per GPU model (node
labels: the model label), a ClusterQueue with a GPU quota and a LocalQueue in the test's
namespace. Loaded as a plugin by tests/conftest.py.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ringwright.devcluster.control_plane import Cluster
from ringwright.devcluster.kueue import API_VERSION, running_kueue
from ringwright.kube import KubeClient, api_path
from ringwright.operator.api.schedulingpolicy import GPU_MODEL_LABEL, GPU_RESOURCE, RACK_LABEL
from ringwright.operator.plan.kueue import PRIORITY_LABEL, QUEUE_LABEL, admission, slice_number
from ringwright.operator.plan.kueue_topology import HOSTNAME
from ringwright.operator.plan.manifests import JOB_LABEL
from ringwright.runtime.checkpoint.checkpointer import Checkpointer
from ringwright.runtime.checkpoint.storage import LocalStorage
from tests.cluster.test_placement_cluster import SLOW, cluster_facts, condition, job
from tests.jobs import OperatorProcess, get_status, instead_of, tj_path
from tests.runtime.elastic_traces import Traces, assert_every_sample_once, assert_params_identical
from tests.waiting import wait_for


@pytest.fixture(scope="module")
def elastic_topology() -> bool:
    """Whether this module's Kueue runs with ElasticJobsViaWorkloadSlicesWithTAS (and its
    operator with kueueElasticTopology); a module overrides this fixture to turn it on."""
    return False


@pytest.fixture(scope="module")
def kueue(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory,
          elastic_topology: bool) -> Iterator[Path]:
    """The real Kueue, running for this module's tests; yields its folder (log)."""
    folder = tmp_path_factory.mktemp("kueue")
    with running_kueue(cluster, folder, elastic_topology=elastic_topology):
        yield folder


@pytest.fixture(scope="module")
def queueing_operator(cluster: Cluster, kueue: Path, operator: OperatorProcess,
                      tmp_path_factory: pytest.TempPathFactory,
                      elastic_topology: bool) -> Iterator[OperatorProcess]:
    """The operator with RINGWRIGHT_KUEUE (and its workload slices) on, instead of the
    session's for this module (both would take the same Lease; the session's is back
    afterwards). Its resync is ten minutes away, so Kueue's answers (admission, eviction,
    a slice admitted) reach a job through the watch on its Workloads, or the tests fail."""
    own = OperatorProcess(cluster, tmp_path_factory.mktemp("kueue-op") / "operator.log",
                          settings={**operator.settings, "RINGWRIGHT_KUEUE": "true",
                                    "RINGWRIGHT_KUEUE_ELASTIC": "true",
                                    "RINGWRIGHT_KUEUE_ELASTIC_TOPOLOGY":
                                        str(elastic_topology).lower(),
                                    "RINGWRIGHT_RESYNC_SECONDS": "600"}, supervised=True)
    with instead_of(operator, own):
        yield own


class Queues:
    """A ClusterQueue over one flavor per GPU model, and a LocalQueue in the namespace."""

    def __init__(self, kube: KubeClient, namespace: str, gpus: int) -> None:
        self.kube, self.namespace = kube, namespace
        suffix = uuid.uuid4().hex[:6]
        self.models = sorted({n.model for n in cluster_facts(kube).values() if n.model})
        self.flavors = {m: f"t-{suffix}-{i}" for i, m in enumerate(self.models)}
        self.cluster_queue = f"t-cq-{suffix}"
        self.local_queue = "team"
        for model, flavor in self.flavors.items():
            self._apply("resourceflavors", {"kind": "ResourceFlavor",
                                            "metadata": {"name": flavor},
                                            "spec": {"nodeLabels": {GPU_MODEL_LABEL: model}}})
        # Only the first model's flavor has GPU quota: admission picks the model.
        groups = [{"coveredResources": ["cpu", "memory", GPU_RESOURCE], "flavors": [
            {"name": self.flavors[self.models[0]], "resources": [
                {"name": "cpu", "nominalQuota": "1000"},
                {"name": "memory", "nominalQuota": "10000Gi"},
                {"name": GPU_RESOURCE, "nominalQuota": str(gpus)}]}]}]
        self._apply("clusterqueues", {"kind": "ClusterQueue",
                                      "metadata": {"name": self.cluster_queue},
                                      "spec": {"namespaceSelector": {},
                                               "preemption": {
                                                   "withinClusterQueue": "LowerPriority"},
                                               "resourceGroups": groups}})
        self.priorities = {"low": f"t-low-{suffix}", "high": f"t-high-{suffix}"}
        for value, name in ((100, self.priorities["low"]), (1000, self.priorities["high"])):
            self._apply("workloadpriorityclasses", {"kind": "WorkloadPriorityClass",
                                                    "metadata": {"name": name},
                                                    "value": value})
        self._apply("localqueues", {"kind": "LocalQueue",
                                    "metadata": {"name": self.local_queue,
                                                 "namespace": namespace},
                                    "spec": {"clusterQueue": self.cluster_queue}})

    def _apply(self, plural: str, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        self.kube.apply(api_path(API_VERSION, plural, meta.get("namespace"), meta["name"]),
                        {"apiVersion": API_VERSION, **obj})

    def cleanup(self) -> None:
        self.kube.delete(api_path(API_VERSION, "localqueues", self.namespace, self.local_queue))
        self.kube.delete(api_path(API_VERSION, "clusterqueues", name=self.cluster_queue))
        for flavor in self.flavors.values():
            self.kube.delete(api_path(API_VERSION, "resourceflavors", name=flavor))
        for name in self.priorities.values():
            self.kube.delete(api_path(API_VERSION, "workloadpriorityclasses", name=name))


@pytest.fixture()
def queues(kube: KubeClient, namespace: str, queueing_operator: OperatorProcess
           ) -> Iterator[Queues]:
    handle = Queues(kube, namespace, gpus=16)
    yield handle
    handle.cleanup()


@pytest.fixture()
def rack_topology(kube: KubeClient, namespace: str, queues: Queues) -> Iterator[str]:
    """A Kueue Topology of the SchedulingPolicy's rack label over hosts, one flavor of the
    first GPU model that uses it, and a ClusterQueue + LocalQueue ("racks") over it."""
    suffix = uuid.uuid4().hex[:6]
    made: list[tuple[str, str, dict[str, Any]]] = [("topologies", f"t-top-{suffix}", {
                "spec": {"levels": [{"nodeLabel": RACK_LABEL}, {"nodeLabel": HOSTNAME}]}}),
            ("resourceflavors", f"t-tas-{suffix}", {
                "spec": {"nodeLabels": {GPU_MODEL_LABEL: queues.models[0]},
                         "topologyName": f"t-top-{suffix}"}}),
            ("clusterqueues", f"t-tas-cq-{suffix}", {"spec": {
                "namespaceSelector": {},
                "resourceGroups": [{"coveredResources": ["cpu", "memory", GPU_RESOURCE],
                                    "flavors": [{"name": f"t-tas-{suffix}", "resources": [
                                        {"name": "cpu", "nominalQuota": "1000"},
                                        {"name": "memory", "nominalQuota": "10000Gi"},
                                        {"name": GPU_RESOURCE, "nominalQuota": "64"}]}]}]}})]
    kinds = {"topologies": "Topology", "resourceflavors": "ResourceFlavor",
             "clusterqueues": "ClusterQueue"}
    for plural, name, body in made:
        kube.apply(api_path(API_VERSION, plural, name=name),
                   {"apiVersion": API_VERSION, "kind": kinds[plural], "metadata": {"name": name},
                    **body})
    local = api_path(API_VERSION, "localqueues", namespace, "racks")
    kube.apply(local, {"apiVersion": API_VERSION, "kind": "LocalQueue",
                       "metadata": {"name": "racks", "namespace": namespace},
                       "spec": {"clusterQueue": f"t-tas-cq-{suffix}"}})
    yield "racks"
    kube.delete(local)
    for plural, name, _ in reversed(made):
        kube.delete(api_path(API_VERSION, plural, name=name))


REQUIRED_TOPOLOGY = "kueue.x-k8s.io/podset-required-topology"
"""The pod-template annotation that asks Kueue for one domain of a topology level."""


def queued_job(name: str, workers: int, gpus: int, queue: str,
               priority: str | None = None,
               worker_annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """A job for ``queue``; ``worker_annotations`` go on the workers' pod template (Kueue
    reads topology requests there)."""
    manifest = job(name, workers, gpus)
    manifest["metadata"]["labels"] = {QUEUE_LABEL: queue}
    if priority is not None:
        manifest["metadata"]["labels"][PRIORITY_LABEL] = priority
    if worker_annotations is not None:
        manifest["spec"]["workers"]["template"]["metadata"] = {
            "annotations": dict(worker_annotations)}
    return manifest


def slices_of(kube: KubeClient, ns: str, name: str) -> list[dict[str, Any]]:
    """Job ``name``'s Workload slices, in order."""
    found = [w for w in kube.list(api_path(API_VERSION, "workloads", ns))
             if w["metadata"].get("labels", {}).get(JOB_LABEL) == name]
    return sorted(found, key=slice_number)


def workload_of(kube: KubeClient, ns: str, name: str) -> dict[str, Any] | None:
    """Job ``name``'s Workload: the oldest slice not finished (else the last)."""
    chain = slices_of(kube, ns, name)
    going = [w for w in chain if not admission(w).finished]
    return going[0] if going else (chain[-1] if chain else None)


def wait_condition(kube: KubeClient, ns: str, name: str, type_: str, status: str
                   ) -> dict[str, Any]:
    def seen() -> dict[str, Any] | None:
        c = condition(kube, ns, name, type_)
        return c if c is not None and c["status"] == status else None

    return wait_for(seen, f"{name}: condition {type_}={status}", timeout=SLOW)


def scale(kube: KubeClient, ns: str, name: str, replicas: int) -> None:
    """Scale job ``name``'s workers through its scale subresource (``kubectl scale``)."""
    kube.merge_patch(tj_path(ns, name, "scale"), {"spec": {"replicas": replicas}})


class EvictionSeen:
    """The wall-clock time this test first saw the job's Workload evicted (polled every
    0.1 s, so at most that much after Kueue set the condition)."""

    def __init__(self, kube: KubeClient, ns: str, job: str) -> None:
        self.at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(kube, ns, job), daemon=True)
        self._thread.start()

    def _poll(self, kube: KubeClient, ns: str, job: str) -> None:
        while self.at is None and not self._stop.wait(0.1):
            workload = workload_of(kube, ns, job) or {}
            if any(c["type"] == "Evicted" and c["status"] == "True"
                   for c in (workload.get("status") or {}).get("conditions") or []):
                self.at = time.time()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def checkpoint_after_eviction(t: Traces, generation: int, folder: Path, held_at: int,
                              evicted: EvictionSeen, where: str) -> int:
    """The step rank 0 stopped at when world ``generation`` was evicted (its last commit
    there, or where its SIGTERM found it), checked to be the newest checkpoint in
    ``folder`` and no earlier than ``held_at``; prints how long after the eviction was
    seen that checkpoint was durable (``where``: the path the figure comes from)."""
    stopped: int = max([r["step"] for _, r in t.events("commit")
                   if r["generation"] == generation and r["rank"] == 0]
                  + [r["step"] for _, r in t.events("terminated") if r["rank"] == 0])
    assert Checkpointer(LocalStorage(folder)).steps()[-1] == stopped >= held_at
    durable = max(f.stat().st_mtime for f in folder.rglob("*") if f.is_file())
    assert evicted.at is not None
    print(f"eviction -> checkpoint durable: {durable - evicted.at:.2f} s "
          f"(step {stopped}; {where}eviction seen within 0.1 s)")
    return stopped


def assert_resumed_once(kube: KubeClient, ns: str, job: str, t: Traces, generation: int,
                        stopped: int, samples: int, epochs: int) -> list[dict[str, Any]]:
    """Job ``job``, preempted in world ``generation`` at step ``stopped``, trained again
    from that step, every sample of every epoch once, parameters identical on every rank,
    and no restart counted (a preemption is no failure); its status's phase history."""
    resumed = [g for g in t.generations() if g > generation]
    assert resumed, f"{job} never trained again"
    assert {r["step"] for r in t.starts(resumed[0]).values()} == {stopped}
    assert_every_sample_once(t, samples, epochs)
    assert_params_identical(t)
    status = get_status(kube, ns, job)
    assert status.get("restarts", 0) == 0, status
    history: list[dict[str, Any]] = status["phaseHistory"]
    return history
