"""Pods on real nodes reach the API server as in-cluster clients do (the `kubernetes`
Service's address, the pod's ServiceAccount token) and reach pods on the other real
node by address; and nothing of the network outlives the nodes."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from ringwright.devcluster.node import host
from ringwright.devcluster.realnode import REAL_NODE_LABEL, RealNodeSet
from ringwright.kube import KubeClient, api_path
from ringwright.objects import Obj
from tests.waiting import wait_for
from tests.xdist_groups import REALNODE_GROUP

# 30 min like the other image modules: on a cold run this module's setup waits for the
# image lane to build the operator image from nothing (the builds take turns).
pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group(REALNODE_GROUP),
              pytest.mark.timeout(1800)]

NODE_IMAGES = ("operator",)
"""The image the nodes start with (tests/realnode/conftest.py)."""

LIST_PODS = """
from ringwright.kube import KubeClient, api_path, in_cluster_config
config = in_cluster_config()
with KubeClient(config) as kube:
    pods = kube.list(api_path("v1", "pods", config.namespace))
print(" ".join(sorted(p["metadata"]["name"] for p in pods)))
"""

FETCH = """
import sys, urllib.request
with urllib.request.urlopen(f"http://{sys.argv[1]}:8080/", timeout=10) as r:
    print(r.status, r.read().decode().count("<li>") > 0)
"""


def _pod(name: str, node: str, image: str, command: list[str],
         restart: str = "Never") -> Obj:
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {
            "restartPolicy": restart,
            "nodeSelector": {"kubernetes.io/hostname": node},
            "tolerations": [{"key": REAL_NODE_LABEL, "operator": "Exists",
                             "effect": "NoSchedule"}],
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": image, "imagePullPolicy": "Never",
                            "command": command}],
        },
    }


def _finished(kube: KubeClient, namespace: str, name: str) -> Obj:
    def done() -> Obj | None:
        pod = kube.get(api_path("v1", "pods", namespace, name))
        return pod if pod["status"].get("phase") in ("Succeeded", "Failed") else None

    return wait_for(done, f"pod {name} to finish", timeout=180)


def _log(kube: KubeClient, namespace: str, name: str) -> str:
    return kube.get_text(api_path("v1", "pods", namespace, name, subresource="log"))


@pytest.fixture()
def may_list_pods(kube: KubeClient, namespace: str) -> Iterator[None]:
    """What a user grants: the namespace's default ServiceAccount may list its pods."""
    kube.create(api_path("rbac.authorization.k8s.io/v1", "roles", namespace), {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": "pod-reader"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]})
    kube.create(api_path("rbac.authorization.k8s.io/v1", "rolebindings", namespace), {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "pod-reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": "pod-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": namespace}]})
    yield


def test_a_pod_lists_pods_through_in_cluster_config(
    kube: KubeClient, namespace: str, real_nodes: RealNodeSet, operator_image: str,
    may_list_pods: None,
) -> None:
    node = real_nodes.nodes[0].name
    kube.create(api_path("v1", "pods", namespace),
                _pod("lister", node, operator_image, ["python", "-c", LIST_PODS]))
    pod = _finished(kube, namespace, "lister")
    assert pod["status"]["phase"] == "Succeeded", (pod["status"], _log(kube, namespace,
                                                                       "lister"))
    assert _log(kube, namespace, "lister").split() == ["lister"]


def test_a_pod_reaches_a_pod_on_the_other_node_by_address(
    kube: KubeClient, namespace: str, real_nodes: RealNodeSet, operator_image: str,
) -> None:
    a, b = (n.name for n in real_nodes.nodes[:2])
    kube.create(api_path("v1", "pods", namespace), _pod(
        "server", b, operator_image,
        ["python", "-m", "http.server", "8080", "--bind", "0.0.0.0", "--directory", "/"]))

    def serving() -> str | None:
        pod = kube.get(api_path("v1", "pods", namespace, "server"))
        running = pod["status"].get("phase") == "Running"
        return pod["status"].get("podIP") if running else None

    address = wait_for(serving, "the server pod to run", timeout=180)
    kube.create(api_path("v1", "pods", namespace),
                _pod("client", a, operator_image, ["python", "-c", FETCH, address]))
    pod = _finished(kube, namespace, "client")
    assert pod["spec"]["nodeName"] == a
    assert pod["status"]["phase"] == "Succeeded", (pod["status"], _log(kube, namespace,
                                                                       "client"))
    assert _log(kube, namespace, "client").split() == ["200", "True"]


def test_the_nodes_share_a_backbone_and_nothing_else(real_nodes: RealNodeSet) -> None:
    """Each node's namespace routes the other's pods over the set's backbone and has no
    default route: pod traffic ends in namespaces the cluster made, or on the host."""
    a, b = real_nodes.nodes[:2]
    assert a.backbone_netns in host.network_namespaces()

    def routes(ns: str) -> str:
        return subprocess.run(["ip", "-n", ns, "route", "show"], capture_output=True,
                              text=True, check=True).stdout

    assert f"{b.pod_cidr} via {b.backbone_ip}" in routes(a.netns)
    assert f"{a.pod_cidr} via {a.backbone_ip}" in routes(b.netns)
    assert "default" not in routes(a.netns) + routes(b.netns)
