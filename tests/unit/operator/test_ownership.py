"""Ownership: a job's objects are the ones its UID controls, whatever their labels say."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ringwright.objects import Obj
from ringwright.operator.api.schedulingpolicy import NodeLabelKeys
from ringwright.operator.observe.job import observe
from ringwright.operator.observe.ownership import controller_uid, owned_by
from ringwright.operator.plan.manifests import JOB_LABEL, ROLE_LABEL, owner_reference, pod
from ringwright.operator.plan.placement.inventory import Inventory
from ringwright.operator.plan.reconcile import plan
from ringwright.world import (
    WORLD_KEY,
    JobRef,
    Member,
    StoreAddress,
    World,
    reports_configmap_name,
    world_configmap_name,
)
from tests.unit.operator.test_reconcile import NODES, SETTINGS, FakePlacer

JOB: Obj = {
    "apiVersion": "ringwright.dev/v1alpha1", "kind": "TrainingJob",
    "metadata": {"name": "tj", "namespace": "ns", "uid": "uid-new", "generation": 1},
    "spec": {"workers": {"min": 1, "replicas": 2, "template": {
        "metadata": {"labels": {JOB_LABEL: "victim", "team": "a"},
                     "annotations": {"ringwright.dev/leaving-since": "1", "note": "x"}},
        "spec": {"containers": [{"name": "train", "image": "img"}]}}}},
}


def _owned_by(uid: str) -> list[Obj]:
    return [{**owner_reference(JOB), "uid": uid}]


def _pod(name: str, uid: str | None) -> Obj:
    meta: Obj = {"name": name, "uid": f"pod-{name}",
                 "labels": {JOB_LABEL: "tj", ROLE_LABEL: "worker"}}
    if uid is not None:
        meta["ownerReferences"] = _owned_by(uid)
    return {"metadata": meta, "spec": {}, "status": {"phase": "Running"}}


def _world_cm(uid: str) -> Obj:
    world = World(job=JobRef(namespace="ns", name="tj"), generation=7,
                  store=StoreAddress(address="127.0.0.1"),
                  members=(Member(rank=0, pod="tj-worker-0", pod_uid="old", ip="127.0.0.1"),))
    return {"metadata": {"name": world_configmap_name("tj"), "ownerReferences": _owned_by(uid)},
            "data": {WORLD_KEY: world.to_json()}}


class FakeCache:
    """The observe step's questions answered from fixed objects."""

    def __init__(self, pods: list[Obj], configmaps: dict[str, Obj]) -> None:
        self.pods, self.configmaps = pods, configmaps

    def job_pods(self, namespace: str, job: str) -> list[Obj]:
        return self.pods

    def configmap(self, namespace: str, name: str) -> Obj | None:
        return self.configmaps.get(name)

    def policy(self, name: str) -> Obj | None:
        return {}

    def priority_value(self, name: str) -> int | None:
        return None

    def inventory(self, labels: NodeLabelKeys, gpu_resource: str,
                  preemptible_below: int | None) -> Inventory:
        return Inventory(())

    def scaffold_object(self, kind: str, namespace: str, name: str) -> Obj | None:
        return self.configmaps.get(name) if kind == "ConfigMap" else None

    def node_down_since(self, name: str) -> float | None:
        return None


def test_controller_uid_reads_only_the_controller_reference() -> None:
    other: Any = {"uid": "not-controller", "controller": False}
    obj = {"metadata": {"ownerReferences": [other, *_owned_by("uid-new")]}}
    assert controller_uid(obj) == "uid-new"
    assert owned_by(obj, "uid-new") and not owned_by(obj, "uid-old")
    assert not owned_by({"metadata": {}}, "uid-new")
    assert not owned_by(obj, "")


def test_foreign_and_earlier_pods_with_the_job_label_are_not_the_jobs() -> None:
    pods = [_pod("tj-worker-0", "uid-new"), _pod("tj-worker-1", "uid-old"),
            _pod("intruder", None)]
    seen = observe(FakeCache(pods, {}), JOB)
    assert [p["metadata"]["name"] for p in seen.pods] == ["tj-worker-0"]


def test_world_and_reports_of_an_earlier_job_of_the_same_name_are_ignored() -> None:
    reports = {"metadata": {"name": reports_configmap_name("tj"),
                            "ownerReferences": _owned_by("uid-old")},
               "data": {"tj-worker-0": '{"kind": "restarted", "generation": 7}'}}
    old = observe(FakeCache([], {world_configmap_name("tj"): _world_cm("uid-old"),
                                 reports_configmap_name("tj"): reports}), JOB)
    assert old.world is None and old.reports == {}
    mine = observe(FakeCache([], {world_configmap_name("tj"): _world_cm("uid-new")}), JOB)
    assert mine.world is not None and mine.world.generation == 7


def test_template_cannot_set_the_operators_labels_or_annotations() -> None:
    made = pod(JOB, "worker", 0, {})
    assert made["metadata"]["labels"][JOB_LABEL] == "tj"
    assert made["metadata"]["labels"]["team"] == "a"
    assert made["metadata"]["annotations"] == {"note": "x"}
    assert controller_uid(made) == "uid-new"


def test_pods_an_earlier_job_of_the_same_name_left_are_deleted_by_uid_never_members() -> None:
    earlier = _pod("tj-worker-0", "uid-old")
    going = _pod("tj-worker-1", "uid-old")
    going["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    seen = observe(FakeCache([earlier, going, _pod("intruder", None)], {}), JOB)
    assert seen.pods == [] and len(seen.left_behind) == 2
    decided = plan(replace(seen, inventory=NODES), SETTINGS, 1_000_000.0, FakePlacer())
    assert decided.delete_left_behind == [("tj-worker-0", "pod-tj-worker-0")]
    assert decided.delete == [] and decided.status.get("restarts", 0) == 0
