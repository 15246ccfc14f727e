"""A job labelled with a Kueue queue: the Workload it publishes, no pods before admission,
the admitted flavor's node labels and count as the placement's constraints."""

from __future__ import annotations

from typing import Any

from ringwright.objects import Obj
from ringwright.operator.api.schedulingpolicy import GPU_RESOURCE, SchedulingPolicySpec
from ringwright.operator.plan.kueue import (
    PRIORITY_LABEL,
    QUEUE_LABEL,
    Admission,
    admission,
    effective_job,
    requeue_evicted,
    workload,
    workload_name,
)
from ringwright.operator.plan.placement.inventory import Inventory, NodeInfo
from ringwright.operator.plan.placement.placer import place
from ringwright.operator.plan.placement.resources import Resources
from ringwright.operator.plan.reconcile import Observed, plan
from tests.unit.operator.test_reconcile import NOW, SETTINGS, job, pod, world_of

GI = 1024**3
QUEUEING = SETTINGS.model_copy(update={"kueue": True})


def queued(replicas: int = 4, minimum: int = 2, **spec: Any) -> Obj:
    body = job(replicas, minimum, gpusPerWorker=2, **spec)
    body["metadata"]["labels"] = {QUEUE_LABEL: "team-a"}
    return body


def wl_status(*conditions: tuple[str, str, str, str], assignments: list[Obj] | None = None
              ) -> Obj:
    status: Obj = {"conditions": [{"type": t, "status": s, "reason": r, "message": m}
                                  for t, s, r, m in conditions]}
    if assignments is not None:
        status["admission"] = {"clusterQueue": "cq", "podSetAssignments": assignments}
    return status


PENDING = wl_status(("QuotaReserved", "False", "Pending",
                     "couldn't assign flavors to pod set workers: insufficient unused quota "
                     "for nvidia.com/gpu in flavor h100, 4 more needed"))


def admitted(count: int = 4, flavor: str = "h100") -> Obj:
    return wl_status(("QuotaReserved", "True", "QuotaReserved", "Quota reserved in cq"),
                     ("Admitted", "True", "Admitted", "The workload is admitted"),
                     assignments=[{"name": "workers", "count": count,
                                   "flavors": {GPU_RESOURCE: flavor, "cpu": flavor}}])


NODES = Inventory(tuple(
    NodeInfo(name=f"{pool}-n{i}", rack=f"rack-{pool}", nvlink_domain=f"{pool}-d",
             gpu_model="H100", free=Resources(64_000, 512 * GI, 8, 110),
             labels=(("pool", pool),))
    for pool in ("a", "b") for i in range(2)))


def published(body: Obj, priority: int | None = None) -> Obj:
    wl = workload(body, "team-a", SchedulingPolicySpec(), priority)
    assert not isinstance(wl, Admission), wl
    return wl


def run(body: Obj, wl_status: Obj | None, pods: list[Obj] | None = None,
        flavors: dict[str, dict[str, str]] | None = None, world: Any = None,
        priority: int | None = None) -> Any:
    wl = None
    if wl_status is not None:
        wl = {**published(body, priority), "status": wl_status}
    observed = Observed(job=body, pods=pods or [], world=world, reports={},
                        policy=SchedulingPolicySpec(), inventory=NODES, workload=wl,
                        flavor_labels=flavors or {}, workload_priority=priority)
    return plan(observed, QUEUEING, NOW, place)


def condition(result: Any, type_: str) -> Obj:
    return next(c for c in result.status["conditions"] if c["type"] == type_)


def test_the_workload_describes_the_gang_and_each_pods_request() -> None:
    body = queued(replicas=4, minimum=2, ps={"replicas": 1, "template": {"spec": {
        "containers": [{"name": "ps", "image": "img",
                        "resources": {"requests": {"cpu": "2"}}}]}}})
    body["spec"]["workers"]["template"]["spec"]["nodeSelector"] = {"disk": "ssd"}
    wl = published(body)
    assert wl["metadata"]["name"] == workload_name(body) == "trainingjob-tj-uid-t"
    assert wl["metadata"]["ownerReferences"][0]["uid"] == "uid-tj"
    assert wl["spec"]["queueName"] == "team-a"
    workers, ps = wl["spec"]["podSets"]
    assert (workers["name"], workers["count"], workers["minCount"]) == ("workers", 4, 2)
    assert workers["template"]["spec"]["containers"][0]["resources"]["limits"] == {
        GPU_RESOURCE: "2"}
    assert workers["template"]["spec"]["nodeSelector"] == {"disk": "ssd"}
    assert (ps["name"], ps["count"]) == ("ps", 1)
    picky = published(queued(gpuModel="H100"))
    assert picky["spec"]["podSets"][0]["template"]["spec"]["nodeSelector"] == {
        "nvidia.com/gpu.product": "H100"}
    assert "minCount" not in ps
    # ps pods are Guaranteed with whole CPUs: Kueue counts what will really be asked.
    assert ps["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] == "2"


def test_before_admission_the_workload_is_published_and_no_pod_exists() -> None:
    first = run(queued(), None)
    assert first.create == []
    assert first.workload is not None and first.workload["kind"] == "Workload"
    assert condition(first, "Queued")["status"] == "True"

    waiting = run(queued(), PENDING)
    assert waiting.create == [] and waiting.workload is None
    queued_cond = condition(waiting, "Queued")
    assert queued_cond["reason"] == "Pending"
    assert "4 more needed" in queued_cond["message"]
    assert condition(waiting, "Admitted")["status"] == "False"
    assert waiting.status["phase"] == "Pending"
    assert [e.reason for e in waiting.events] == ["Queued"]


def test_admission_creates_pods_on_the_flavors_nodes_only() -> None:
    result = run(queued(), admitted(), flavors={"h100": {"pool": "b"}})
    assert len(result.create) == 4
    for p in result.create:
        assert p["spec"]["nodeSelector"] == {"pool": "b"}
        assert p["metadata"]["annotations"]["ringwright.dev/planned-node"].startswith("b-")
    assert condition(result, "Admitted")["status"] == "True"
    assert "h100" in condition(result, "Admitted")["message"]
    assert condition(result, "Queued")["status"] == "False"


def test_partial_admission_creates_only_the_admitted_count() -> None:
    result = run(queued(replicas=4, minimum=2), admitted(count=3),
                 flavors={"h100": {"pool": "a"}})
    assert len(result.create) == 3


def test_a_flavor_no_node_carries_is_a_constraint_refusal_not_a_loop() -> None:
    result = run(queued(), admitted(), flavors={"h100": {"pool": "c"}})
    assert result.create == []
    schedulable = condition(result, "Schedulable")
    assert schedulable["reason"] == "NodeConstraintsUnsatisfiable"
    assert "nodeSelector pool=c leaves 0 of 4" in schedulable["message"]


EVICTED = wl_status(("Evicted", "True", "Preempted", "Preempted to accommodate a "
                     "workload (UID: x) due to prioritization in the ClusterQueue"),
                    ("QuotaReserved", "True", "QuotaReserved", "Quota reserved in cq"),
                    ("Admitted", "True", "Admitted", "The workload is admitted"),
                    assignments=[{"name": "workers", "count": 4, "flavors": {}}])


def test_eviction_suspends_the_job_gracefully_then_hands_the_workload_back() -> None:
    running = queued(status={"phase": "Running"})
    result = run(running, EVICTED, pods=[pod(0), pod(1)], world=world_of([0, 1]))
    # As a suspend: an empty world, pods with their grace period (checkpoint on SIGTERM).
    assert sorted(result.delete_gracefully) == ["tj-worker-0", "tj-worker-1"]
    assert result.world is not None and result.world.members == ()
    assert result.create == []
    assert result.status["phase"] == "Suspended"
    assert condition(result, "Queued")["reason"] == "Preempted"
    assert condition(result, "Suspended")["message"].startswith("evicted by Kueue")
    assert result.workload_requeue is None  # not before the pods are gone

    gone = run(queued(status={"phase": "Suspended"}), EVICTED)
    patch = gone.workload_requeue
    assert patch is not None and patch["status"]["admission"] is None
    by_type = {c["type"]: c for c in patch["status"]["conditions"]}
    assert by_type["QuotaReserved"]["status"] == "False"
    assert by_type["Admitted"]["status"] == "False"
    assert (by_type["Requeued"]["status"], by_type["Requeued"]["reason"]) == ("True",
                                                                               "Preempted")
    assert by_type["Evicted"]["status"] == "True"  # Kueue's to reset on readmission


def test_readmission_resumes_a_suspended_job() -> None:
    result = run(queued(status={"phase": "Suspended"}), admitted(),
                 flavors={"h100": {"pool": "a"}})
    assert result.status["phase"] == "Pending"
    assert len(result.create) == 4


def test_requeue_patch_only_for_an_evicted_workload_holding_quota() -> None:
    assert requeue_evicted({"status": admitted()}, NOW) is None
    assert requeue_evicted({"status": wl_status(("Evicted", "True", "Preempted", "m"))},
                           NOW) is None


def test_priority_class_label_sets_the_workloads_priority() -> None:
    body = queued()
    body["metadata"]["labels"][PRIORITY_LABEL] = "urgent"
    wl = published(body, priority=1000)
    assert wl["spec"]["priority"] == 1000
    assert wl["spec"]["priorityClassRef"] == {"group": "kueue.x-k8s.io",
                                              "kind": "WorkloadPriorityClass", "name": "urgent"}
    missing = run(body, None)
    assert missing.workload is None and missing.create == []
    assert condition(missing, "Queued")["reason"] == "WorkloadPriorityClassNotFound"


def test_a_finished_job_marks_its_workload_finished() -> None:
    body = queued(status={"phase": "Succeeded"})
    result = run(body, admitted())
    assert result.workload_finished == "TrainingJob Succeeded"
    done = wl_status(("Finished", "True", "JobFinished", "TrainingJob Succeeded"))
    assert run(body, done).workload_finished == ""
    assert admission({"status": done}).finished


def test_without_the_label_nothing_changes() -> None:
    body = job(4, 2, gpusPerWorker=2)
    result = run(body, None)
    assert result.workload is None and len(result.create) == 4
    assert not [c for c in result.status["conditions"] if c["type"] in ("Queued", "Admitted")]


def test_with_the_integration_off_the_label_is_ignored() -> None:
    observed = Observed(job=queued(), pods=[], world=None, reports={},
                        policy=SchedulingPolicySpec(), inventory=NODES)
    result = plan(observed, SETTINGS, NOW, place)
    assert result.workload is None and len(result.create) == 4


def test_effective_job_merges_flavor_labels_over_the_users_selector() -> None:
    body = queued()
    body["spec"]["workers"]["template"]["spec"]["nodeSelector"] = {"disk": "ssd", "pool": "x"}
    given = admission({"status": admitted()})
    out = effective_job(body, given, {"h100": {"pool": "b"}})
    assert out["spec"]["workers"]["template"]["spec"]["nodeSelector"] == {
        "disk": "ssd", "pool": "b"}
    assert body["spec"]["workers"]["template"]["spec"]["nodeSelector"]["pool"] == "x"


def test_the_policys_allowed_models_keep_kueue_off_other_flavors() -> None:
    policy = SchedulingPolicySpec(allowedGpuModels=["A100", "H100"])
    body = queued()
    body["spec"]["workers"]["template"]["spec"]["affinity"] = {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "disk", "operator": "In", "values": ["ssd"]}]}]}}}
    wl = workload(body, "team-a", policy)
    assert not isinstance(wl, Admission)
    spec = wl["spec"]["podSets"][0]["template"]["spec"]
    (term,) = spec["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [
        {"key": "disk", "operator": "In", "values": ["ssd"]},
        {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["A100", "H100"]}]
    # A job naming its model already selects it; one without GPUs asks for no model.
    named = workload(queued(gpuModel="H100"), "team-a", policy)
    assert not isinstance(named, Admission)
    assert "affinity" not in named["spec"]["podSets"][0]["template"]["spec"]
    cpu = workload(job(2, 1, gpusPerWorker=0), "team-a", policy)
    assert not isinstance(cpu, Admission)
    assert "affinity" not in cpu["spec"]["podSets"][0]["template"]["spec"]
