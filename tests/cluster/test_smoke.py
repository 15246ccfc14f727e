"""The local control plane behaves like a real cluster: scheduling, GC, namespaces."""

from __future__ import annotations

from typing import Any

import pytest

from ringwright.devcluster.inventory import GPU_RESOURCE, RACK_LABEL
from ringwright.kube import KubeClient, api_path
from tests.waiting import wait_for

pytestmark = pytest.mark.cluster


def _pod(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"containers": [{"name": "main", "image": "busybox", **spec.pop("container", {})}],
                 **spec},
    }


def test_required_rack_affinity_binds_to_that_rack_with_a_loopback_ip(
    kube: KubeClient, namespace: str
) -> None:
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": RACK_LABEL, "operator": "In", "values": ["rack-2"]}]}]}}}
    kube.create(api_path("v1", "pods", namespace), _pod("pinned", affinity=affinity))

    def running() -> dict[str, Any] | None:
        pod = kube.get(api_path("v1", "pods", namespace, "pinned"))
        return pod if pod.get("status", {}).get("phase") == "Running" else None

    pod = wait_for(running, "pod pinned to rack-2 to run")
    node = kube.get(api_path("v1", "nodes", name=pod["spec"]["nodeName"]))
    assert node["metadata"]["labels"][RACK_LABEL] == "rack-2"
    assert pod["status"]["podIP"].startswith("127.")


def test_pod_asking_more_gpus_than_any_node_has_stays_pending_with_reason(
    kube: KubeClient, namespace: str
) -> None:
    container = {"resources": {"limits": {GPU_RESOURCE: "9"}}}
    kube.create(api_path("v1", "pods", namespace), _pod("greedy", container=container))

    def unschedulable() -> dict[str, Any] | None:
        pod = kube.get(api_path("v1", "pods", namespace, "greedy"))
        for cond in pod.get("status", {}).get("conditions", []):
            if cond["type"] == "PodScheduled" and cond.get("reason") == "Unschedulable":
                found: dict[str, Any] = cond
                return found
        return None

    cond = wait_for(unschedulable, "the scheduler to report the pod unschedulable")
    assert f"Insufficient {GPU_RESOURCE}" in cond["message"]
    pod = kube.get(api_path("v1", "pods", namespace, "greedy"))
    assert pod["status"]["phase"] == "Pending"
    assert not pod["spec"].get("nodeName")


def test_deleting_an_owner_garbage_collects_its_dependents(
    kube: KubeClient, namespace: str
) -> None:
    owner = kube.create(api_path("v1", "configmaps", namespace),
                        {"metadata": {"name": "owner"}, "data": {}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
           "uid": owner["metadata"]["uid"]}
    dependent = _pod("dependent")
    dependent["metadata"]["ownerReferences"] = [ref]
    kube.create(api_path("v1", "pods", namespace), dependent)
    kube.create(api_path("v1", "configmaps", namespace),
                {"metadata": {"name": "dependent", "ownerReferences": [ref]}})

    kube.delete(api_path("v1", "configmaps", namespace, "owner"))

    wait_for(lambda: kube.get_or_none(api_path("v1", "pods", namespace, "dependent")) is None,
             "the garbage collector to delete the dependent pod")
    wait_for(
        lambda: kube.get_or_none(api_path("v1", "configmaps", namespace, "dependent")) is None,
        "the garbage collector to delete the dependent ConfigMap",
    )


def test_deleting_a_namespace_removes_it_and_its_pods(kube: KubeClient) -> None:
    kube.create(api_path("v1", "namespaces"), {"metadata": {"name": "doomed"}})
    kube.create(api_path("v1", "pods", "doomed"), _pod("victim"))
    wait_for(lambda: kube.get(api_path("v1", "pods", "doomed", "victim"))
             .get("status", {}).get("podIP"), "the pod to start")

    kube.delete(api_path("v1", "namespaces", name="doomed"))

    wait_for(lambda: kube.get_or_none(api_path("v1", "namespaces", name="doomed")) is None,
             "the namespace to disappear", timeout=90)
