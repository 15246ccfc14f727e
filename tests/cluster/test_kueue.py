"""TrainingJobs queued through the real Kueue (v0.17, built from its Go module), on KWOK
nodes (the pods run no training; tests/e2e/test_kueue_preemption_job.py trains through a
preemption). The Kueue fixtures and queues: tests/queueing.py.
"""

from __future__ import annotations

import pytest

from ringwright.kube import KubeClient, api_path
from ringwright.operator.api.schedulingpolicy import GPU_MODEL_LABEL, GPU_RESOURCE, RACK_LABEL
from ringwright.operator.plan.kueue import API_VERSION, assigned_domains
from tests.cluster.test_placement_cluster import (
    SLOW,
    cluster_facts,
    condition,
    pods_of,
    wait_quiet,
    wait_running,
)
from tests.jobs import get_status, reconciled, tj_path
from tests.queueing import (
    REQUIRED_TOPOLOGY,
    Queues,
    queued_job,
    scale,
    slices_of,
    wait_condition,
    workload_of,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.cluster

HOSTNAME = "kubernetes.io/hostname"


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


def gpus_in_use(kube: KubeClient, queues: Queues) -> float:
    """The GPUs the ClusterQueue counts as used (its status's flavorsUsage)."""
    cq = kube.get(api_path(API_VERSION, "clusterqueues", name=queues.cluster_queue))
    return sum(float(r.get("total", 0)) for f in (cq.get("status") or {}).get("flavorsUsage") or ()
               for r in f.get("resources") or () if r["name"] == GPU_RESOURCE)


def test_a_job_grows_within_its_quota_waits_for_more_and_shrinks_at_once(
    kube: KubeClient, namespace: str, queues: Queues
) -> None:
    ns = namespace
    wait_quiet(kube, ns)

    # 8 + 4 of 16 GPUs.
    kube.create(tj_path(ns), queued_job("elastic", 2, 4, queues.local_queue))
    kube.create(tj_path(ns), queued_job("other", 1, 4, queues.local_queue))
    wait_running(kube, ns, "elastic", 2)
    other, _ = wait_running(kube, ns, "other", 1)

    # A third worker fits: a new slice is admitted in place of the first.
    scale(kube, ns, "elastic", 3)
    wait_running(kube, ns, "elastic", 3)
    first, grown = slices_of(kube, ns, "elastic")[:2]
    finished = next(c for c in first["status"]["conditions"] if c["type"] == "Finished")
    assert (finished["status"], finished["reason"]) == ("True", "WorkloadSliceReplaced")
    assert grown["status"]["admission"]["podSetAssignments"][0]["count"] == 3

    # A fourth does not (16 + 4 > 16): the job runs three and says why.
    scale(kube, ns, "elastic", 4)
    waiting = wait_condition(kube, ns, "elastic", "WaitingForQuota", "True")
    assert "4 workers (3 admitted)" in waiting["message"], waiting
    reconciled(kube, ns, "elastic", timeout=SLOW)
    assert len(pods_of(kube, ns, "elastic")) == 3

    # The other job ends: its quota frees and the waiting slice is admitted.
    kube.merge_patch(api_path("v1", "pods", ns, other.members[0].pod, "status"),
                     {"status": {"phase": "Succeeded"}})
    wait_running(kube, ns, "elastic", 4)
    wait_condition(kube, ns, "elastic", "WaitingForQuota", "False")

    # Down to two: the admitted slice shrinks in place and hands 8 GPUs back at once.
    scale(kube, ns, "elastic", 2)
    wait_running(kube, ns, "elastic", 2)
    wait_for(lambda: gpus_in_use(kube, queues) == 8, "the ClusterQueue to count 8 GPUs",
             timeout=SLOW)
    assert workload_of(kube, ns, "elastic")["spec"]["podSets"][0]["count"] == 2  # type: ignore[index]


def test_a_job_asking_kueue_for_one_rack_lands_on_the_hosts_kueue_assigned(
    kube: KubeClient, namespace: str, rack_topology: str
) -> None:
    ns = namespace
    wait_quiet(kube, ns)
    # 3 workers of 4 GPUs: two 8-GPU hosts, in one rack whichever the planner would pick.
    kube.create(tj_path(ns), queued_job("racked", 3, 4, rack_topology,
                                        worker_annotations={REQUIRED_TOPOLOGY: RACK_LABEL}))
    wait_condition(kube, ns, "racked", "Admitted", "True")
    wait_running(kube, ns, "racked", 3)
    wl = workload_of(kube, ns, "racked")
    assert wl is not None and wl["spec"]["podSets"][0]["topologyRequest"] == {
        "required": RACK_LABEL}
    # Kueue keeps only the lowest level (the hosts) of an assignment that reaches them.
    domains = dict(assigned_domains(
        wl["status"]["admission"]["podSetAssignments"][0]["topologyAssignment"]))
    hosts = set(domains[HOSTNAME])
    facts = cluster_facts(kube)
    assert len({facts[h].rack for h in hosts}) == 1, domains
    placed = {p["spec"]["nodeName"] for p in pods_of(kube, ns, "racked")}
    assert placed <= hosts, (placed, domains)

    # Without Kueue's ElasticJobsViaWorkloadSlicesWithTAS gate a new slice would get a
    # topology unrelated to the running pods': the job keeps its size and says why.
    scale(kube, ns, "racked", 4)
    fixed = wait_condition(kube, ns, "racked", "Resizable", "False")
    assert "asked for 4 workers but Kueue admitted 3" in fixed["message"], fixed
    assert "(required request)" in fixed["message"], fixed
    reconciled(kube, ns, "racked", timeout=SLOW)
    assert len(pods_of(kube, ns, "racked")) == 3
    assert len(slices_of(kube, ns, "racked")) == 1
