"""Topology-aware placement through the real kube-scheduler.

The operator only writes node affinity and a priority class on its pods; the real
kube-scheduler binds them (KWOK plays the kubelet). Every expectation here is computed
from the Node objects and the pods already bound when a job is created, never guessed:
which GPU models exist, what each rack has free, the fewest racks that can hold a job.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from ringwright.devcluster.control_plane import Cluster
from ringwright.devcluster.demo import current_world
from ringwright.kube import ApiError, KubeClient, api_path
from ringwright.operator.api.base import API_VERSION
from ringwright.operator.api.schedulingpolicy import (
    GPU_MODEL_LABEL,
    GPU_RESOURCE,
    NVLINK_DOMAIN_LABEL,
    RACK_LABEL,
    SchedulingPolicySpec,
)
from ringwright.operator.plan.manifests import INDEX_LABEL, JOB_LABEL, ROLE_LABEL
from ringwright.operator.plan.placement.resources import millicores, whole
from ringwright.world import World
from tests.jobs import OperatorProcess, get_status, reconciled, tj_path, training_job
from tests.waiting import wait_for

pytestmark = pytest.mark.cluster

POLICIES = api_path(API_VERSION, "schedulingpolicies")
PRIORITY_CLASSES = api_path("scheduling.k8s.io/v1", "priorityclasses")
SLOW = 180.0
"""Generous wait: the machine is small and shared with other test runs."""


# --- what the cluster holds ----------------------------------------------------------------


@dataclass(frozen=True)
class NodeFacts:
    """One node as a test sees it: where it sits and what it has free right now."""

    name: str
    rack: str
    domain: str
    model: str
    free_gpus: int
    free_cpu_milli: int


def _requests(pod: dict[str, Any]) -> tuple[int, int]:
    """(GPUs, CPU millicores) a pod's containers request (a bare limit counts as a request)."""
    gpus = cpu = 0
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        merged = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        gpus += whole(merged.get(GPU_RESOURCE, 0))
        cpu += millicores(merged.get("cpu", 0))
    return gpus, cpu


def cluster_facts(kube: KubeClient) -> dict[str, NodeFacts]:
    """Every node with its topology labels and free GPUs / CPU, from the live objects."""
    used: dict[str, tuple[int, int]] = defaultdict(lambda: (0, 0))
    for pod in kube.list(api_path("v1", "pods")):
        node = (pod.get("spec") or {}).get("nodeName")
        if node and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            g, c = _requests(pod)
            used[node] = (used[node][0] + g, used[node][1] + c)
    out = {}
    for node in kube.list(api_path("v1", "nodes")):
        labels = node["metadata"].get("labels") or {}
        alloc = node["status"]["allocatable"]
        name = node["metadata"]["name"]
        out[name] = NodeFacts(
            name=name,
            rack=labels.get(RACK_LABEL, ""),
            domain=labels.get(NVLINK_DOMAIN_LABEL, ""),
            model=labels.get(GPU_MODEL_LABEL, ""),
            free_gpus=whole(alloc.get(GPU_RESOURCE, 0)) - used[name][0],
            free_cpu_milli=millicores(alloc.get("cpu", 0)) - used[name][1],
        )
    return out


def slots_per_rack(facts: dict[str, NodeFacts], model: str, gpus: int) -> dict[str, int]:
    """Workers of ``gpus`` GPUs each that fit per rack on nodes of ``model``."""
    out: dict[str, int] = defaultdict(int)
    for n in facts.values():
        if n.model == model and n.free_gpus >= gpus:
            out[n.rack] += n.free_gpus // gpus
    return dict(out)


def fewest_racks(slots: dict[str, int], need: int) -> int | None:
    """The fewest racks whose room adds up to ``need`` (largest first is optimal); None: never."""
    total = 0
    for count, room in enumerate(sorted(slots.values(), reverse=True), start=1):
        total += room
        if total >= need:
            return count
    return None


def models_in(facts: dict[str, NodeFacts]) -> list[str]:
    return sorted({n.model for n in facts.values() if n.model})


def expected_model(facts: dict[str, NodeFacts], workers: int, gpus: int,
                   preference: list[str]) -> tuple[str, int]:
    """The model a job should get and the racks it needs there.

    The policy's order of preference breaks ties between models that hold the job in
    equally few racks (no preference listed: the models present, by name).
    """
    options = []
    for order, model in enumerate(preference):
        racks = fewest_racks(slots_per_rack(facts, model, gpus), workers)
        if racks is not None:
            options.append((racks, order, model))
    assert options, f"no model holds {workers} workers of {gpus} GPUs: the test setup is wrong"
    racks, _, model = min(options)
    return model, racks


def wait_quiet(kube: KubeClient, namespace: str) -> None:
    """Wait until pods of earlier tests (namespaces being deleted) are gone.

    Expectations are computed from free room, so nothing else may be releasing it.
    """
    wait_for(lambda: not [p for p in kube.list(api_path("v1", "pods"))
                          if p["metadata"]["namespace"] != namespace],
             "pods of earlier tests to be gone", timeout=SLOW, interval=0.5)


# --- the job's pods and world --------------------------------------------------------------


def pods_of(kube: KubeClient, ns: str, name: str, role: str = "worker") -> list[dict[str, Any]]:
    return kube.list(api_path("v1", "pods", ns), labelSelector=f"{JOB_LABEL}={name},"
                     f"{ROLE_LABEL}={role}")


def pods_when(kube: KubeClient, ns: str, name: str, count: int,
              ready: Callable[[dict[str, Any]], bool],
              role: str = "worker") -> list[dict[str, Any]] | None:
    """The job's ``role`` pods once there are ``count`` and each satisfies ``ready``."""
    pods = pods_of(kube, ns, name, role)
    return pods if len(pods) == count and all(ready(p) for p in pods) else None


def running(pod: dict[str, Any]) -> bool:
    return bool(pod["status"].get("phase") == "Running")


def bound(pod: dict[str, Any]) -> bool:
    return bool(pod["spec"].get("nodeName"))


def all_pods_of(kube: KubeClient, ns: str, name: str) -> list[dict[str, Any]]:
    return kube.list(api_path("v1", "pods", ns), labelSelector=f"{JOB_LABEL}={name}")


def wait_running(kube: KubeClient, ns: str, name: str, size: int) -> tuple[World, dict[str, Any]]:
    """The job's world once it holds ``size`` pods and the status mirrors that generation.

    Pods, not ranks: a worker with several GPUs runs one rank per GPU by default
    (``numProcPerNode: auto``), and placement is about pods."""

    def settled() -> tuple[World, dict[str, Any]] | None:
        world = current_world(kube, ns, name)
        if world is None or len({m.pod for m in world.members}) != size:
            return None
        status = get_status(kube, ns, name)
        mirrored = (status.get("world") or {}).get("generation") == world.generation
        return (world, status) if mirrored and status.get("phase") == "Running" else None

    return wait_for(settled, f"{name}: a Running world of {size} pods", timeout=SLOW)


def condition(kube: KubeClient, ns: str, name: str, type_: str) -> dict[str, Any] | None:
    conds = get_status(kube, ns, name).get("conditions") or []
    return next((c for c in conds if c["type"] == type_), None)


def wait_unschedulable(kube: KubeClient, ns: str, name: str) -> dict[str, Any]:
    def refused() -> dict[str, Any] | None:
        c = condition(kube, ns, name, "Schedulable")
        return c if c is not None and c["status"] == "False" else None

    return wait_for(refused, f"{name}: a Schedulable=False condition", timeout=SLOW)


def stays_pending_without_pods(kube: KubeClient, ns: str, *names: str) -> None:
    """The operator reconciles the jobs again (a round that began now: it is alive and
    decided afresh), and the jobs are still Pending and own no pods."""
    for name in names:
        status = reconciled(kube, ns, name, timeout=SLOW)
        assert status["phase"] == "Pending", name
        assert all_pods_of(kube, ns, name) == [], name


def scheduled_by_kube_scheduler(kube: KubeClient, ns: str, pods: list[str]) -> None:
    """Every pod got a Scheduled event from the default scheduler (nobody set nodeName)."""

    def all_seen() -> bool:
        seen = {e["involvedObject"]["name"]
                for e in kube.list(api_path("v1", "events", ns), fieldSelector="reason=Scheduled")
                if (e.get("reportingComponent") or (e.get("source") or {}).get("component"))
                == "default-scheduler"}
        return set(pods) <= seen

    wait_for(all_seen, "Scheduled events from the default scheduler", timeout=SLOW)


def check_placement(kube: KubeClient, ns: str, name: str, size: int,
                    facts: dict[str, NodeFacts], preference: list[str], gpus: int
                    ) -> tuple[str, set[str]]:
    """Assert where the job's workers landed against the free inventory ``facts``.

    Returns the job's GPU model and its racks.
    """
    world, status = wait_running(kube, ns, name, size)
    pods = {p["metadata"]["name"]: p for p in pods_of(kube, ns, name)}
    assert sorted(pods) == sorted({m.pod for m in world.members})
    scheduled_by_kube_scheduler(kube, ns, list(pods))

    nodes = [pods[m.pod]["spec"]["nodeName"] for m in world.members]
    assert all(nodes), "every worker is bound"
    models = {facts[n].model for n in nodes}
    racks = {facts[n].rack for n in nodes}
    want_model, want_racks = expected_model(facts, size, gpus, preference)
    assert models == {want_model}, f"one GPU model for the whole job, {want_model}"
    assert len(racks) == want_racks, (
        f"{len(racks)} racks used; {want_racks} hold {size} workers of {gpus} GPUs")

    # Ring order: (rack, NVLink domain, node, pod index), from the nodes' own labels.
    keys = [(facts[n].rack, facts[n].domain, n, int(pods[m.pod]["metadata"]["labels"]
                                                  [INDEX_LABEL]))
            for m, n in zip(world.members, nodes, strict=True)]
    assert keys == sorted(keys), f"world not in ring order: {keys}"
    for m, n in zip(world.members, nodes, strict=True):
        assert (m.node, m.rack, m.nvlink_domain, m.gpu_model) == (
            n, facts[n].rack, facts[n].domain, facts[n].model)

    summary = status["world"]
    assert summary["gpuModel"] == want_model
    assert summary["racks"] == len(racks)
    assert summary["crossRackEdges"] == (len(racks) if len(racks) > 1 else 0)
    return want_model, racks


# --- admin objects -------------------------------------------------------------------------


@pytest.fixture()
def admin(cluster: Cluster, kube: KubeClient) -> Iterator[Admin]:
    handle = Admin(cluster, kube)
    yield handle
    handle.cleanup()


class Admin:
    """Cluster-scoped objects a test creates (policies, priority classes), removed after it."""

    def __init__(self, cluster: Cluster, kube: KubeClient) -> None:
        self.cluster, self.kube = cluster, kube
        self.suffix = uuid.uuid4().hex[:6]
        self.created: list[str] = []

    def name(self, base: str) -> str:
        return f"t-{base}-{self.suffix}"

    def kubectl_apply(self, manifest: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        """``kubectl apply -f -`` as the admin would; the API's own apply without kubectl."""
        path = api_path(manifest["apiVersion"], _plural(manifest["kind"]),
                        name=manifest["metadata"]["name"])
        if path not in self.created:
            self.created.append(path)
        kubectl = shutil.which("kubectl")
        if kubectl is None:
            try:
                self.kube.apply(path, manifest)
            except ApiError as err:
                return subprocess.CompletedProcess([], 1, "", err.message)
            return subprocess.CompletedProcess([], 0, "", "")
        return subprocess.run(
            [kubectl, "--kubeconfig", str(self.cluster.kubeconfig), "apply", "-f", "-"],
            input=yaml.safe_dump(manifest), capture_output=True, text=True, check=False)

    def policy(self, name: str, spec: dict[str, Any]) -> None:
        done = self.kubectl_apply({"apiVersion": API_VERSION, "kind": "SchedulingPolicy",
                                   "metadata": {"name": name}, "spec": spec})
        assert done.returncode == 0, done.stderr

    def cleanup(self) -> None:
        for path in reversed(self.created):
            self.kube.delete(path)


def _plural(kind: str) -> str:
    return {"SchedulingPolicy": "schedulingpolicies", "PriorityClass": "priorityclasses"}[kind]


def job(name: str, workers: int, gpus: int, minimum: int | None = None,
        **spec: Any) -> dict[str, Any]:
    manifest = training_job(name, replicas=workers, minimum=minimum or workers,
                            gpusPerWorker=gpus, **spec)
    manifest["spec"]["workers"]["max"] = max(workers, 16)
    return manifest


# --- tests ---------------------------------------------------------------------------------


def test_jobs_land_on_one_model_in_the_fewest_racks_in_ring_order(
    kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    wait_quiet(kube, namespace)
    # A job bigger than any rack: it must span racks, and the ring crosses each boundary once.
    before = cluster_facts(kube)
    biggest_rack = max(max(slots_per_rack(before, m, 1).values()) for m in models_in(before))
    wide = biggest_rack + biggest_rack // 4
    kube.create(tj_path(namespace), job("wide", wide, 1, minimum=wide // 2))
    _, wide_racks = check_placement(kube, namespace, "wide", wide, before, models_in(before), 1)
    assert len(wide_racks) > 1

    # A second job on what is left fits one rack, and takes the tightest one that holds it.
    after = cluster_facts(kube)
    snug = 12
    kube.create(tj_path(namespace), job("snug", snug, 2))
    model, racks = check_placement(kube, namespace, "snug", snug, after, models_in(after), 2)
    (rack,) = racks
    room = slots_per_rack(after, model, 2)
    assert room[rack] == min(r for r in room.values() if r >= snug), (
        f"rack {rack} ({room[rack]} free slots) is not the tightest fit among {room}")
    for p in pods_of(kube, namespace, "snug"):
        assert p["spec"]["priorityClassName"] == SchedulingPolicySpec().priority_classes.worker


def test_requested_gpu_model_is_the_only_model_used(
    kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    wait_quiet(kube, namespace)
    facts = cluster_facts(kube)
    # The model the planner would not pick by itself (it breaks ties by name).
    wanted = models_in(facts)[-1]
    kube.create(tj_path(namespace), job("picky", 6, 4, gpuModel=wanted))
    model, _ = check_placement(kube, namespace, "picky", 6, facts, [wanted], 4)
    assert model == wanted
    for p in pods_of(kube, namespace, "picky"):
        required = p["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert all({"key": GPU_MODEL_LABEL, "operator": "In", "values": [wanted]}
                   in term["matchExpressions"] for term in required)


def test_model_outside_the_policy_stays_pending_without_pods(
    kube: KubeClient, namespace: str, operator: OperatorProcess, admin: Admin
) -> None:
    models = models_in(cluster_facts(kube))
    allowed, refused = models[0], models[-1]
    policy = admin.name("only-one-model")
    admin.policy(policy, {"allowedGpuModels": [allowed]})
    kube.create(tj_path(namespace), job("banned", 2, 1, gpuModel=refused,
                                        schedulingPolicyName=policy))
    cond = wait_unschedulable(kube, namespace, "banned")
    assert cond["reason"] == "GPUModelNotAllowed"
    assert refused in cond["message"] and allowed in cond["message"]
    stays_pending_without_pods(kube, namespace, "banned")


def test_applied_policy_changes_placement_of_new_jobs(
    kube: KubeClient, namespace: str, operator: OperatorProcess, admin: Admin
) -> None:
    wait_quiet(kube, namespace)
    models = models_in(cluster_facts(kube))
    policy = admin.name("model-order")
    admin.policy(policy, {"allowedGpuModels": list(reversed(models))})
    facts = cluster_facts(kube)
    kube.create(tj_path(namespace), job("first", 4, 8, schedulingPolicyName=policy))
    first_model, _ = check_placement(kube, namespace, "first", 4, facts,
                                     list(reversed(models)), 8)
    assert first_model == models[-1]

    # The admin flips the order; the next job follows it, the running one stays put.
    admin.policy(policy, {"allowedGpuModels": models})
    facts = cluster_facts(kube)
    kube.create(tj_path(namespace), job("second", 4, 8, schedulingPolicyName=policy))
    second_model, _ = check_placement(kube, namespace, "second", 4, facts, models, 8)
    assert second_model == models[0] != first_model
    assert {cluster_facts(kube)[p["spec"]["nodeName"]].model
            for p in pods_of(kube, namespace, "first")} == {first_model}


def test_policy_rack_limit_holds_a_job_until_the_admin_relaxes_it(
    kube: KubeClient, namespace: str, operator: OperatorProcess, admin: Admin
) -> None:
    wait_quiet(kube, namespace)
    facts = cluster_facts(kube)
    models = models_in(facts)
    biggest_rack = max(max(slots_per_rack(facts, m, 1).values()) for m in models)
    size = biggest_rack + 1
    policy = admin.name("one-rack")
    admin.policy(policy, {"rackPacking": "Required", "limits": {"maxRacksPerJob": 1}})
    kube.create(tj_path(namespace), job("boxed", size, 1, schedulingPolicyName=policy))

    cond = wait_unschedulable(kube, namespace, "boxed")
    assert cond["reason"] == "InsufficientCapacity"
    assert f"needs {size} x " in cond["message"]
    assert "within 1 racks" in cond["message"]
    assert f"room for {biggest_rack}" in cond["message"]
    stays_pending_without_pods(kube, namespace, "boxed")

    admin.policy(policy, {"rackPacking": "Required", "limits": {"maxRacksPerJob": 2}})
    _, racks = check_placement(kube, namespace, "boxed", size, facts, models, 1)
    assert len(racks) == 2
    for p in pods_of(kube, namespace, "boxed"):
        required = p["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert all({"key": RACK_LABEL, "operator": "In", "values": sorted(racks)}
                   in term["matchExpressions"] for term in required)


def test_invalid_policy_is_refused_at_admission_and_loses_nothing(
    kube: KubeClient, api: None, admin: Admin
) -> None:
    name = admin.name("strict")
    admin.policy(name, {"allowedGpuModels": ["NVIDIA-H100-80GB-HBM3"]})
    kept = kube.get(f"{POLICIES}/{name}")["spec"]
    for spec, field in (
        ({"priorityClasses": {"worker": "same", "ps": "same"}}, "spec.priorityClasses.ps"),
        ({"rackPacking": "Sometimes"}, "spec.rackPacking"),
        ({"limits": {"maxRacksPerJob": 0}}, "spec.limits.maxRacksPerJob"),
    ):
        for target in (name, admin.name("fresh")):
            done = admin.kubectl_apply({"apiVersion": API_VERSION, "kind": "SchedulingPolicy",
                                        "metadata": {"name": target}, "spec": spec})
            assert done.returncode != 0, f"{spec} was accepted"
            assert field in done.stderr, done.stderr
    assert kube.get(f"{POLICIES}/{name}")["spec"] == kept
    assert kube.get_or_none(f"{POLICIES}/{admin.name('fresh')}") is None


def test_job_whose_minimum_cannot_fit_stays_pending_with_numbers(
    kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    wait_quiet(kube, namespace)
    facts = cluster_facts(kube)
    room = {m: sum(slots_per_rack(facts, m, 8).values()) for m in models_in(facts)}
    need = max(room.values()) + 4
    kube.create(tj_path(namespace), job("gang", need, 8))
    cond = wait_unschedulable(kube, namespace, "gang")
    assert cond["reason"] == "InsufficientCapacity"
    assert f"needs {need} x " in cond["message"]
    for model, slots in room.items():
        assert model in cond["message"]
        assert f"room for {slots}" in cond["message"]

    # Enough nodes in total, but not within the job's own rack bound.
    per_rack = max(max(slots_per_rack(facts, m, 8).values()) for m in room)
    kube.create(tj_path(namespace), job("tight", per_rack + 1, 8,
                                        topology={"maxRacks": 1}))
    cond = wait_unschedulable(kube, namespace, "tight")
    assert f"needs {per_rack + 1} x " in cond["message"]
    assert "within 1 racks" in cond["message"]
    assert f"room for {per_rack}" in cond["message"]

    stays_pending_without_pods(kube, namespace, "gang", "tight")


def _ps_job(name: str, workers: int, ps: int) -> dict[str, Any]:
    manifest = job(name, workers, 1, mode="ParameterServer")
    manifest["spec"]["ps"] = {"replicas": ps, "template": {"spec": {"containers": [
        {"name": "ps", "image": "ringwright/training:dev",
         "resources": {"requests": {"cpu": "1500m"}}}]}}}
    return manifest


def _priority_value(kube: KubeClient, name: str) -> int:
    value: int = kube.get(f"{PRIORITY_CLASSES}/{name}")["value"]
    return value


def test_ps_pods_are_high_priority_guaranteed_and_near_the_workers(
    kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    wait_quiet(kube, namespace)
    facts = cluster_facts(kube)
    kube.create(tj_path(namespace), _ps_job("sharded", 8, 2))
    _, worker_racks = check_placement(kube, namespace, "sharded", 8, facts, models_in(facts), 1)

    classes = SchedulingPolicySpec().priority_classes
    ps = wait_for(lambda: pods_when(kube, namespace, "sharded", 2, running, "ps"),
                  "two Running ps pods", timeout=SLOW)
    workers = pods_of(kube, namespace, "sharded")
    ps_priority = _priority_value(kube, classes.ps)
    assert ps_priority > _priority_value(kube, classes.worker)
    for p in ps:
        assert p["spec"]["priorityClassName"] == classes.ps
        assert p["spec"]["priority"] == ps_priority
        assert all(p["spec"]["priority"] > w["spec"]["priority"] for w in workers)
        assert p["status"]["qosClass"] == "Guaranteed"
        for c in p["spec"]["containers"]:
            res = c["resources"]
            assert res["requests"] == res["limits"]
            assert str(res["requests"]["cpu"]).isdigit(), "whole CPUs"
            assert res["requests"]["cpu"] == "2"  # 1500m rounded up
        # The workers' racks have CPU to spare, so the ps pods sit inside them.
        assert facts[p["spec"]["nodeName"]].rack in worker_racks
    assert len({p["spec"]["nodeName"] for p in ps}) == 2, "ps pods spread over nodes"


def test_ps_pod_preempts_a_low_priority_filler_when_the_cluster_is_full(
    kube: KubeClient, namespace: str, operator: OperatorProcess, admin: Admin
) -> None:
    wait_quiet(kube, namespace)
    filler_class = admin.name("filler")
    done = admin.kubectl_apply({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                                "metadata": {"name": filler_class}, "value": 10,
                                "description": "test filler, preemptible"})
    assert done.returncode == 0, done.stderr

    # One filler per node holding every free CPU, bound by the scheduler like any pod.
    facts = cluster_facts(kube)
    for n in facts.values():
        kube.create(api_path("v1", "pods", namespace), {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"filler-{n.name}", "labels": {"app": "filler"}},
            "spec": {
                "priorityClassName": filler_class,
                "nodeSelector": {"kubernetes.io/hostname": n.name},
                "terminationGracePeriodSeconds": 0,
                "containers": [{"name": "busy", "image": "busybox", "resources": {
                    "requests": {"cpu": f"{n.free_cpu_milli}m"}}}],
            },
        })

    def fillers() -> dict[str, dict[str, Any]]:
        return {p["metadata"]["name"]: p for p in kube.list(api_path("v1", "pods", namespace),
                                                            labelSelector="app=filler")}

    wait_for(lambda: len(f := fillers()) == len(facts)
             and all(p["status"].get("phase") == "Running" for p in f.values()),
             "every filler Running", timeout=SLOW)
    assert all(n.free_cpu_milli == 0 for n in cluster_facts(kube).values())

    kube.create(tj_path(namespace), _ps_job("pushy", 2, 1))
    (ps,) = wait_for(lambda: pods_when(kube, namespace, "pushy", 1, running, "ps"),
                     "the ps pod Running after preempting a filler", timeout=SLOW)
    node = ps["spec"]["nodeName"]
    workers = wait_for(lambda: pods_when(kube, namespace, "pushy", 2, bound),
                       "both workers bound", timeout=SLOW)
    assert facts[node].rack in {facts[w["spec"]["nodeName"]].rack for w in workers}

    left = fillers()
    assert f"filler-{node}" not in left, "the filler on the ps pod's node was preempted"
    assert len(left) == len(facts) - 1, "exactly one filler made room"
    preempted = [e for e in kube.list(api_path("v1", "events", namespace),
                                      fieldSelector="reason=Preempted")
                 if e["involvedObject"]["name"] == f"filler-{node}"]
    assert preempted, "the scheduler recorded the preemption"
