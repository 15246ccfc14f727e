"""The operator against the real API server and scheduler: lifecycle, elasticity, failures."""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

import pytest

from ringwright.devcluster.control_plane import Cluster
from ringwright.devcluster.demo import current_world
from ringwright.kube import KubeClient, api_path
from ringwright.operator.plan.manifests import (
    INDEX_LABEL,
    JOB_LABEL,
    LEAVING_ANNOTATION,
    ROLE_LABEL,
)
from ringwright.world import World
from tests.jobs import OperatorProcess, get_status, tj_path, training_job
from tests.waiting import wait_for

pytestmark = pytest.mark.cluster


def pods_of(kube: KubeClient, ns: str, name: str) -> list[dict[str, Any]]:
    return kube.list(api_path("v1", "pods", ns),
                     labelSelector=f"{JOB_LABEL}={name},{ROLE_LABEL}=worker")


def wait_world(kube: KubeClient, ns: str, name: str, size: int | None, after: int = 0,
               timeout: float = 60) -> World:
    """Job ``name``'s first world past generation ``after`` of ``size`` members (any size
    when None)."""
    def grown() -> World | None:
        world = current_world(kube, ns, name)
        return world if world is not None and size in (None, world.size) \
            and world.generation > after else None

    return wait_for(grown, f"world of size {size} after generation {after}", timeout=timeout)


def world_now(kube: KubeClient, ns: str, name: str) -> World:
    """Job ``name``'s published world; fails the test when there is none yet."""
    world = current_world(kube, ns, name)
    assert world is not None, f"{ns}/{name} has no published world"
    return world


def events_of(kube: KubeClient, ns: str, name: str) -> list[str]:
    return [e["reason"] for e in kube.list(api_path("v1", "events", ns),
                                          fieldSelector=f"involvedObject.name={name}")]


def test_job_runs_with_world_status_and_events(
    kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    kube.create(tj_path(namespace), training_job("basic"))

    world = wait_world(kube, namespace, "basic", 4)
    status = wait_for(lambda: (s := get_status(kube, namespace, "basic"))
                      .get("phase") == "Running" and s, "phase Running")
    assert status["world"]["generation"] == world.generation and status["world"]["size"] == 4
    assert status["workers"]["ready"] == 4
    assert status["observedGeneration"] >= 1
    assert [m.rank for m in world.members] == [0, 1, 2, 3]
    assert all(m.ip.startswith("127.") for m in world.members)
    assert world.store.address == world.members[0].ip
    racks = [m.rack for m in world.members]
    assert len(set(racks)) == status["world"]["racks"]
    assert {"WorldPublished", "Running"} <= set(events_of(kube, namespace, "basic"))
    # The job's pods may read their world and patch reports: the scaffold is in place.
    for path in (api_path("v1", "serviceaccounts", namespace, "basic-runtime"),
                 api_path("rbac.authorization.k8s.io/v1", "roles", namespace, "basic-runtime"),
                 api_path("v1", "services", namespace, "basic"),
                 api_path("v1", "configmaps", namespace, "basic-reports")):
        assert kube.get_or_none(path) is not None, path


def test_scale_subresource_grows_and_shrinks_the_world(
    kube: KubeClient, namespace: str, operator: OperatorProcess, cluster: Cluster
) -> None:
    kube.create(tj_path(namespace), training_job("elastic", replicas=2, minimum=1))
    first = wait_world(kube, namespace, "elastic", 2)

    kubectl = shutil.which("kubectl")
    if kubectl:
        subprocess.run([kubectl, "--kubeconfig", str(cluster.kubeconfig), "-n", namespace,
                        "scale", "tj/elastic", "--replicas=4"], check=True)
    else:
        kube.merge_patch(tj_path(namespace, "elastic", "scale"), {"spec": {"replicas": 4}})
    grown = wait_world(kube, namespace, "elastic", 4, after=first.generation)
    survivors = [m.pod for m in grown.members if m.pod in {x.pod for x in first.members}]
    assert survivors == [m.pod for m in first.members]  # relative order kept

    kube.merge_patch(tj_path(namespace, "elastic", "scale"), {"spec": {"replicas": 2}})
    shrunk = wait_world(kube, namespace, "elastic", 2, after=grown.generation)
    # Highest ranks leave first, and their pods go once the drain window passes.
    assert [m.pod for m in shrunk.members] == [m.pod for m in grown.members[:2]]
    wait_for(lambda: len(pods_of(kube, namespace, "elastic")) == 2, "leaving pods deleted")
    scale = kube.get(tj_path(namespace, "elastic", "scale"))
    assert scale["spec"]["replicas"] == 2


def test_deleted_worker_is_replaced_and_the_generation_moves_on(
    kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    kube.create(tj_path(namespace), training_job("heal", replicas=3, minimum=2))
    before = wait_world(kube, namespace, "heal", 3)
    victim = before.members[1]
    kube.delete(api_path("v1", "pods", namespace, victim.pod), grace=0)

    # The replacement may be ready within the settle window: then one generation covers
    # both the loss and the rejoin, otherwise a smaller world comes first.
    healed = wait_world(kube, namespace, "heal", 3, after=before.generation)
    replacement = next(m for m in healed.members if m.pod == victim.pod)  # same name
    assert replacement.pod_uid != victim.pod_uid  # new pod
    status = get_status(kube, namespace, "heal")
    assert status["restarts"] == 1
    assert "MemberLost" in events_of(kube, namespace, "heal")


def test_missing_policy_is_reported_as_a_condition(
    kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    kube.create(tj_path(namespace), training_job("lost", schedulingPolicyName="nope"))

    def reported() -> dict[str, Any] | None:
        conds = get_status(kube, namespace, "lost").get("conditions") or []
        return next((c for c in conds if c["reason"] == "PolicyNotFound"), None)

    cond = wait_for(reported, "a PolicyNotFound condition")
    assert "'nope' does not exist" in cond["message"]
    assert pods_of(kube, namespace, "lost") == []


def test_job_that_cannot_fit_stays_pending_without_pods(
    kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    job = training_job("huge", replicas=40, minimum=40, gpusPerWorker=8)
    job["spec"]["workers"]["max"] = 40
    kube.create(tj_path(namespace), job)

    def unschedulable() -> dict[str, Any] | None:
        conds = get_status(kube, namespace, "huge").get("conditions") or []
        return next((c for c in conds if c["type"] == "Schedulable"
                     and c["status"] == "False"), None)

    cond = wait_for(unschedulable, "a Schedulable=False condition")
    assert "40" in cond["message"]
    assert get_status(kube, namespace, "huge")["phase"] == "Pending"
    assert pods_of(kube, namespace, "huge") == []


def test_suspend_removes_pods_and_resume_brings_them_back(
    kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    kube.create(tj_path(namespace), training_job("nap", replicas=2, minimum=1))
    wait_world(kube, namespace, "nap", 2)
    kube.merge_patch(tj_path(namespace, "nap"), {"spec": {"runPolicy": {"suspend": True}}})
    wait_for(lambda: get_status(kube, namespace, "nap").get("phase") == "Suspended"
             and not pods_of(kube, namespace, "nap"), "suspended without pods")
    kube.merge_patch(tj_path(namespace, "nap"), {"spec": {"runPolicy": {"suspend": False}}})
    wait_for(lambda: get_status(kube, namespace, "nap").get("phase") == "Running",
             "running again")
    assert len(pods_of(kube, namespace, "nap")) == 2


def test_rank0_success_completes_the_job_and_cleans_running_pods_after_their_grace(
    kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    kube.create(tj_path(namespace), training_job("done", replicas=2, minimum=1))
    world = wait_world(kube, namespace, "done", 2)
    rank0 = world.members[0].pod
    kube.merge_patch(api_path("v1", "pods", namespace, rank0, "status"),
                     {"status": {"phase": "Succeeded"}})
    wait_for(lambda: get_status(kube, namespace, "done").get("phase") == "Succeeded",
             "phase Succeeded")
    # The other member gets the grace to end on its own (its last step, logs, metrics)...
    other = [p for p in pods_of(kube, namespace, "done") if p["metadata"]["name"] != rank0]
    assert [p["metadata"].get("deletionTimestamp") for p in other] == [None]
    # ... and is deleted when it does not (cleanPodPolicy Running).
    wait_for(lambda: [p["metadata"]["name"] for p in pods_of(kube, namespace, "done")] == [rank0],
             "the still-running worker deleted (cleanPodPolicy Running)")


def test_operator_killed_mid_scale_up_converges_without_duplicates(
    kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    kube.create(tj_path(namespace), training_job("crash", replicas=2, minimum=1))
    wait_world(kube, namespace, "crash", 2)

    kube.merge_patch(tj_path(namespace, "crash", "scale"), {"spec": {"replicas": 8}})
    wait_for(lambda: len(pods_of(kube, namespace, "crash")) > 2, "scale-up to begin",
             interval=0.02)
    operator.kill()
    # While it is down a worker fails.
    victim = pods_of(kube, namespace, "crash")[0]["metadata"]
    kube.delete(api_path("v1", "pods", namespace, victim["name"]), grace=0)
    wait_for(lambda: victim["uid"] not in
             [p["metadata"]["uid"] for p in pods_of(kube, namespace, "crash")],
             "the failed worker to be gone")
    down_world = world_now(kube, namespace, "crash")
    down_pods = {p["metadata"]["name"] for p in pods_of(kube, namespace, "crash")}
    restarted = operator.log_offset()
    operator.start()

    grown = wait_world(kube, namespace, "crash", 8, after=down_world.generation, timeout=120)
    # The operator logs a world after writing it: read its log once the line of the world
    # just seen is there, not at once (under load the line came after the test read).
    logged = f"published world {namespace}/crash generation={grown.generation} "

    def lines_through_grown() -> list[str] | None:
        lines = operator.log_since(restarted)
        return lines if any(logged in line for line in lines) else None

    lines = wait_for(lines_through_grown, f"the operator's log line {logged!r}")
    # Nothing reacted while the operator was down: the restarted one found the job as the
    # outage left it. It created exactly the pods missing then (the victim's among them)
    # and its first world is the one after the last world before the outage.
    ours = [line for line in lines if f" {namespace}/crash" in line]
    created = {line.rsplit("/", 1)[1] for line in ours if "created pod" in line}
    assert created == {f"crash-worker-{i}" for i in range(8)} - down_pods, ours
    assert victim["name"] in created
    published = [int(line.split("generation=")[1].split()[0]) for line in ours
                 if "published world" in line]
    assert published and published[0] == down_world.generation + 1, (down_world.generation,
                                                                      published)
    pods = pods_of(kube, namespace, "crash")
    # One pod per index, 0..7: nothing created twice under another name, nothing skipped.
    assert sorted(int(p["metadata"]["labels"][INDEX_LABEL]) for p in pods) == list(range(8))
    assert sorted(m.pod for m in grown.members) == sorted(p["metadata"]["name"] for p in pods)
    assert victim["uid"] not in [m.pod_uid for m in grown.members]
    assert all(p["metadata"]["ownerReferences"][0]["name"] == "crash" for p in pods)
    assert not any(LEAVING_ANNOTATION in (p["metadata"].get("annotations") or {}) for p in pods)
    assert json.loads(json.dumps(get_status(kube, namespace, "crash")))["phase"] == "Running"

