"""TrainingJobs queued through the real Kueue (v0.17, built from its Go module).

Kueue runs once for this module against the session's cluster, and an operator with the
Kueue integration on replaces the session's operator meanwhile. Each test makes its own
ResourceFlavor per GPU model (node labels: the model label), a ClusterQueue with a GPU
quota and a LocalQueue in its namespace.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ringwright.devcluster.control_plane import Cluster
from ringwright.devcluster.kueue import API_VERSION, running_kueue
from ringwright.kube import KubeClient, api_path
from ringwright.operator.api.schedulingpolicy import GPU_MODEL_LABEL, GPU_RESOURCE
from ringwright.operator.plan.kueue import PRIORITY_LABEL, QUEUE_LABEL
from tests.cluster.test_placement_cluster import (
    SLOW,
    cluster_facts,
    condition,
    job,
    pods_of,
    wait_quiet,
    wait_running,
)
from tests.jobs import OperatorProcess, get_status, instead_of, reconciled, tj_path
from tests.waiting import wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def kueue(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The real Kueue, running for this module's tests; yields its folder (log)."""
    folder = tmp_path_factory.mktemp("kueue")
    with running_kueue(cluster, folder):
        yield folder


@pytest.fixture(scope="module")
def queueing_operator(cluster: Cluster, kueue: Path, operator: OperatorProcess,
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    """The operator with RINGWRIGHT_KUEUE on, instead of the session's for this module
    (both would take the same Lease; the session's is back afterwards)."""
    own = OperatorProcess(cluster, tmp_path_factory.mktemp("kueue-op") / "operator.log",
                          settings={**operator.settings, "RINGWRIGHT_KUEUE": "true"})
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


def queued_job(name: str, workers: int, gpus: int, queue: str,
               priority: str | None = None) -> dict[str, Any]:
    manifest = job(name, workers, gpus)
    manifest["metadata"]["labels"] = {QUEUE_LABEL: queue}
    if priority is not None:
        manifest["metadata"]["labels"][PRIORITY_LABEL] = priority
    return manifest


def workload_of(kube: KubeClient, ns: str, name: str) -> dict[str, Any] | None:
    found = [w for w in kube.list(api_path(API_VERSION, "workloads", ns))
             if w["metadata"].get("labels", {}).get("ringwright.dev/job") == name]
    return found[0] if found else None


def wait_condition(kube: KubeClient, ns: str, name: str, type_: str, status: str
                   ) -> dict[str, Any]:
    def seen() -> dict[str, Any] | None:
        c = condition(kube, ns, name, type_)
        return c if c is not None and c["status"] == status else None

    return wait_for(seen, f"{name}: condition {type_}={status}", timeout=SLOW)


def test_admitted_job_runs_on_the_flavors_model_after_admission(
    kube: KubeClient, namespace: str, queues: Queues
) -> None:
    wait_quiet(kube, namespace)
    kube.create(tj_path(namespace), queued_job("admitted", 2, 4, queues.local_queue))
    wl = wait_for(lambda: workload_of(kube, namespace, "admitted"), "the job's Workload",
                  timeout=SLOW)
    (workers,) = wl["spec"]["podSets"]
    assert (workers["name"], workers["count"]) == ("workers", 2)
    assert wl["spec"]["queueName"] == queues.local_queue
    admitted = wait_condition(kube, namespace, "admitted", "Admitted", "True")
    assert queues.flavors[queues.models[0]] in admitted["message"]
    wait_running(kube, namespace, "admitted", 2)
    facts = cluster_facts(kube)
    for p in pods_of(kube, namespace, "admitted"):
        assert p["spec"]["nodeSelector"][GPU_MODEL_LABEL] == queues.models[0]
        assert facts[p["spec"]["nodeName"]].model == queues.models[0]
    # Kueue's own record: the Workload holds the quota.
    held = workload_of(kube, namespace, "admitted")
    assert held is not None
    assert held["status"]["admission"]["clusterQueue"] == queues.cluster_queue


def test_over_quota_job_is_queued_with_kueues_reason_until_the_first_finishes(
    kube: KubeClient, namespace: str, queues: Queues
) -> None:
    wait_quiet(kube, namespace)
    kube.create(tj_path(namespace), queued_job("first", 3, 4, queues.local_queue))
    wait_condition(kube, namespace, "first", "Admitted", "True")
    world, _ = wait_running(kube, namespace, "first", 3)

    # 12 of 16 GPUs are held: 8 more do not fit, and Kueue says so.
    kube.create(tj_path(namespace), queued_job("second", 2, 4, queues.local_queue))
    waiting = wait_for(lambda: (c := condition(kube, namespace, "second", "Queued"))
                       and c["status"] == "True" and "quota" in c["message"] and c,
                       "second: Queued with Kueue's quota message", timeout=SLOW)
    assert GPU_RESOURCE in waiting["message"], waiting
    status = reconciled(kube, namespace, "second", timeout=SLOW)
    assert status["phase"] == "Pending"
    assert pods_of(kube, namespace, "second") == []

    # The first finishes (rank 0 succeeds): its Workload is Finished, the quota is free.
    rank0 = world.members[0].pod
    kube.merge_patch(api_path("v1", "pods", namespace, rank0, "status"),
                     {"status": {"phase": "Succeeded"}})
    wait_for(lambda: get_status(kube, namespace, "first").get("phase") == "Succeeded",
             "first: Succeeded", timeout=SLOW)
    wait_condition(kube, namespace, "second", "Admitted", "True")
    wait_running(kube, namespace, "second", 2)
    finished = workload_of(kube, namespace, "first")
    assert finished is not None and any(
        c["type"] == "Finished" and c["status"] == "True"
        for c in finished["status"]["conditions"])


def test_higher_priority_job_preempts_a_running_one_which_suspends_and_comes_back(
    kube: KubeClient, namespace: str, queues: Queues
) -> None:
    wait_quiet(kube, namespace)
    kube.create(tj_path(namespace), queued_job("low", 3, 4, queues.local_queue,
                                               queues.priorities["low"]))
    wait_running(kube, namespace, "low", 3)
    low_wl = workload_of(kube, namespace, "low")
    assert low_wl is not None and low_wl["spec"]["priority"] == 100

    # 12 of 16 GPUs held at priority 100; 8 asked at 1000: Kueue preempts "low".
    kube.create(tj_path(namespace), queued_job("high", 2, 4, queues.local_queue,
                                               queues.priorities["high"]))
    suspended = wait_for(
        lambda: (s := get_status(kube, namespace, "low")).get("phase") == "Suspended" and s,
        "low: Suspended after its eviction", timeout=SLOW)
    evicted = next(c for c in suspended["conditions"] if c["type"] == "Suspended")
    assert evicted["reason"] == "Preempted", evicted
    assert evicted["message"].startswith("evicted by Kueue"), evicted
    wait_running(kube, namespace, "high", 2)
    assert pods_of(kube, namespace, "low") == []
    queued = condition(kube, namespace, "low", "Queued")
    assert queued is not None and queued["status"] == "True", queued

    # "high" finishes: "low" is admitted again and runs, its restarts untouched.
    world, _ = wait_running(kube, namespace, "high", 2)
    kube.merge_patch(api_path("v1", "pods", namespace, world.members[0].pod, "status"),
                     {"status": {"phase": "Succeeded"}})
    wait_condition(kube, namespace, "low", "Admitted", "True")
    _, status = wait_running(kube, namespace, "low", 3)
    assert status.get("restarts", 0) == 0
    phases = [t["phase"] for t in status["phaseHistory"]]
    assert phases[-3:] == ["Suspended", "Pending", "Running"], phases


def test_a_job_larger_than_the_quota_runs_as_many_workers_as_kueue_admits(
    kube: KubeClient, namespace: str, queues: Queues
) -> None:
    wait_quiet(kube, namespace)
    # 6 workers of 4 GPUs against 16 GPUs of quota, gang of 2: Kueue admits 4.
    manifest = queued_job("partial", 6, 4, queues.local_queue)
    manifest["spec"]["workers"]["min"] = 2
    kube.create(tj_path(namespace), manifest)
    wl = wait_for(lambda: workload_of(kube, namespace, "partial"), "the job's Workload",
                  timeout=SLOW)
    assert (wl["spec"]["podSets"][0]["count"], wl["spec"]["podSets"][0]["minCount"]) == (6, 2)
    wait_condition(kube, namespace, "partial", "Admitted", "True")
    wait_running(kube, namespace, "partial", 4)
    admitted = workload_of(kube, namespace, "partial")
    assert admitted is not None
    (workers,) = admitted["status"]["admission"]["podSetAssignments"]
    assert workers["count"] == 4
    # Rounds go on and never exceed what was admitted.
    reconciled(kube, namespace, "partial", timeout=SLOW)
    assert len(pods_of(kube, namespace, "partial")) == 4
