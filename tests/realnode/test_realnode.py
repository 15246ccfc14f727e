"""Real nodes beside the KWOK nodes: a real kubelet registers with its labels and GPUs,
runs a container of the local image as a non-root user, serves its logs and exec
through the API server; KWOK leaves it alone; and removing a set of real nodes, also
one whose starter crashed, leaves nothing behind on the host."""

from __future__ import annotations

import os
import subprocess
import sys
from ipaddress import ip_address, ip_network

import pytest
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.stream import stream

from ringwright.devcluster.control_plane import NODE_DOWN_ANNOTATION, Cluster
from ringwright.devcluster.inventory import GPU_RESOURCE, KWOK_NODE_ANNOTATION
from ringwright.devcluster.node import host, registry
from ringwright.devcluster.node.layout import NodeLayout
from ringwright.devcluster.realnode import (
    REAL_NODE_LABEL,
    RealNodeSet,
    node_ready,
    pause_image,
    sweep_stale_real_nodes,
)
from ringwright.devcluster.versions import KUBERNETES
from ringwright.kube import KubeClient, api_path
from ringwright.objects import Obj
from tests.waiting import wait_for
from tests.xdist_groups import REALNODE_GROUP

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group(REALNODE_GROUP)]

USER = 10001
NOT_READY_TAINT = "node.kubernetes.io/not-ready"


def _pod(name: str, node: str, command: list[str] | None = None) -> Obj:
    """A pod of the local image for real node ``node``, as user and group 10001 (the
    image's entrypoint, without ``command``, sleeps until stopped)."""
    container: Obj = {"name": "main", "image": pause_image(), "imagePullPolicy": "Never"}
    if command:
        container["command"] = command
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {"kubernetes.io/hostname": node},
            "tolerations": [{"key": REAL_NODE_LABEL, "operator": "Exists",
                             "effect": "NoSchedule"}],
            "securityContext": {"runAsUser": USER, "runAsGroup": USER, "runAsNonRoot": True},
            "terminationGracePeriodSeconds": 1,
            "containers": [container],
        },
    }


def _node(kube: KubeClient, name: str) -> Obj:
    return kube.get(api_path("v1", "nodes", name=name))


def _ready_condition(node: Obj) -> Obj:
    return next(c for c in node["status"]["conditions"] if c["type"] == "Ready")


def test_a_real_node_registers_ready_with_its_labels_and_gpus(
    kube: KubeClient, real_nodes: RealNodeSet,
) -> None:
    layout = real_nodes.nodes[0]
    node = _node(kube, layout.name)
    assert node_ready(node)
    labels = node["metadata"]["labels"]
    assert {k: labels.get(k) for k in layout.spec.labels()} == {
        REAL_NODE_LABEL: "true", "ringwright.dev/rack": "rack-r0",
        "nvidia.com/gpu.clique": "rack-r0-nvl-3",
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB",
    }
    status = node["status"]
    assert status["capacity"][GPU_RESOURCE] == "4"
    assert status["allocatable"][GPU_RESOURCE] == "4"
    assert status["nodeInfo"]["kubeletVersion"] == KUBERNETES
    assert status["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    assert {"type": "InternalIP", "address": layout.node_ip} in status["addresses"]
    assert {"key": REAL_NODE_LABEL, "value": "true", "effect": "NoSchedule"} \
        in node["spec"]["taints"]


def test_a_pod_of_the_local_image_runs_as_its_user_and_its_logs_are_served(
    kube: KubeClient, namespace: str, real_nodes: RealNodeSet,
) -> None:
    layout = real_nodes.nodes[0]
    kube.create(api_path("v1", "pods", namespace), _pod("whoami", layout.name, ["/pause", "id"]))

    def finished_pod() -> Obj | None:
        pod = kube.get(api_path("v1", "pods", namespace, "whoami"))
        return pod if pod["status"].get("phase") in ("Succeeded", "Failed") else None

    pod = wait_for(finished_pod, "the pod to run to completion on the real node", timeout=120)
    assert pod["status"]["phase"] == "Succeeded", pod["status"]
    assert pod["spec"]["nodeName"] == layout.name
    finished = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert finished["exitCode"] == 0
    assert finished["containerID"].startswith("containerd://")
    assert ip_address(pod["status"]["podIP"]) in ip_network(layout.pod_cidr)
    # What `kubectl logs` asks: the API server fetches it from the kubelet.
    log = kube.get_text(api_path("v1", "pods", namespace, "whoami", subresource="log"))
    assert log == f"uid={USER} gid={USER}\n"


def test_exec_runs_a_command_in_a_running_container(
    cluster: Cluster, kube: KubeClient, namespace: str, real_nodes: RealNodeSet,
) -> None:
    """What `kubectl exec` does: the API server asks the kubelet, which streams from
    containerd's streaming server in the node's namespace."""
    kube.create(api_path("v1", "pods", namespace), _pod("target", real_nodes.nodes[0].name))
    wait_for(lambda: kube.get(api_path("v1", "pods", namespace, "target"))
             ["status"].get("phase") == "Running", "the pod to run", timeout=120)
    with k8s_config.new_client_from_config(config_file=str(cluster.kubeconfig)) as api:
        out = stream(k8s_client.CoreV1Api(api).connect_get_namespaced_pod_exec, "target",
                     namespace, command=["/pause", "echo", "from", "exec"], stdout=True,
                     stderr=True, stdin=False, tty=False)
    assert out == "from exec\n"


def _set_down(kube: KubeClient, node: str, down: bool) -> None:
    kube.merge_patch(api_path("v1", "nodes", name=node), {"metadata": {"annotations": {
        NODE_DOWN_ANNOTATION: "true" if down else None}}})


def test_kwok_leaves_the_real_node_alone(kube: KubeClient, real_nodes: RealNodeSet) -> None:
    """The annotation that makes KWOK report a node down goes onto the real node first,
    then onto a KWOK node; once KWOK has taken the KWOK node down, the real node's
    Ready condition is still the one its kubelet set at registration."""
    real = real_nodes.nodes[0].name
    before = _ready_condition(_node(kube, real))
    kwok_node = max(n["metadata"]["name"] for n in kube.list(api_path("v1", "nodes"))
                    if KWOK_NODE_ANNOTATION in (n["metadata"].get("annotations") or {}))
    _set_down(kube, real, True)
    _set_down(kube, kwok_node, True)
    try:
        wait_for(lambda: not node_ready(_node(kube, kwok_node)),
                 "KWOK to report its node down", timeout=60)
        after = _ready_condition(_node(kube, real))
        assert after["status"] == "True"
        assert after["reason"] == "KubeletReady"
        assert after["lastTransitionTime"] == before["lastTransitionTime"]
    finally:
        _set_down(kube, real, False)
        _set_down(kube, kwok_node, False)
        wait_for(lambda: node_ready(node := _node(kube, kwok_node)) and not any(
            t["key"] == NOT_READY_TAINT for t in node["spec"].get("taints") or ()),
            "the KWOK node to be Ready and untainted again", timeout=60)


def _leftovers(layout: NodeLayout, processes: list[host.Proc]) -> dict[str, list[str]]:
    """What of ``layout``'s node is on the host, by kind (empty lists: nothing)."""
    route = subprocess.run(["ip", "route", "show", layout.pod_cidr], capture_output=True,
                           text=True, check=False).stdout.strip()
    return {
        "started processes": [f"{p.role} {p.pid}" for p in processes if p.alive()],
        "processes naming the node's folder": [
            str(pid) for pid in host.pids_mentioning(str(layout.dir))],
        "processes in the node's cgroups": [str(p) for p in host.cgroup_pids(layout.cgroup)],
        "cgroups": host.cgroups_named(layout.netns),
        "network namespaces": [ns for ns in host.network_namespaces()
                               if ns in (layout.netns, layout.backbone_netns)],
        "host link": [link for link in host.host_links() if link == layout.host_link],
        "route to the pods": [route] if route else [],
        "folder": [str(layout.dir)] if layout.dir.exists() else [],
    }


CRASHING_STARTER = """
import sys
from pathlib import Path
from ringwright.devcluster.realnode import RealNodeSpec, start_real_nodes
from ringwright.kube import KubeClient, load_kubeconfig
cluster_dir, kubeconfig, name = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
with KubeClient(load_kubeconfig(kubeconfig)) as kube:
    nodes = start_real_nodes(kube, cluster_dir, kubeconfig, [RealNodeSpec(name)])
print(nodes.record.slot)
"""
"""Starts a real node and exits without stopping it, as a crashed test run would."""


def test_a_crashed_runs_real_node_is_removed_without_a_trace(
    cluster: Cluster, kube: KubeClient, namespace: str, real_nodes: RealNodeSet,
) -> None:
    name = "real-crashed-node"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    started = subprocess.run(
        [sys.executable, "-c", CRASHING_STARTER, str(cluster.dir), str(cluster.kubeconfig),
         name], env=env, capture_output=True, text=True, timeout=400, check=False)
    assert started.returncode == 0, started.stderr[-4000:]
    slot = int(started.stdout.split()[-1])
    record = next(r for r in registry.Registry().records() if r.slot == slot)
    assert not record.owner_alive()
    layout = record.layouts()[0]
    kube.create(api_path("v1", "pods", namespace), _pod("sleeper", name))
    wait_for(lambda: kube.get(api_path("v1", "pods", namespace, "sleeper"))
             ["status"].get("phase") == "Running", "a pod running on the orphaned node",
             timeout=120)
    running = _leftovers(layout, record.processes)
    assert all(running.values()), running
    # Its mounts live in the node's own mount namespace, never in the host's.
    assert host.mounts_under(layout.dir) == []

    assert slot in sweep_stale_real_nodes()

    assert not any(_leftovers(layout, record.processes).values()), \
        _leftovers(layout, record.processes)
    assert not registry.Registry().path(slot).exists()
    # Removing it again (as Cluster.down would) is harmless; it also forgets the Node.
    RealNodeSet(record, registry.Registry()).stop(kube)
    assert kube.get_or_none(api_path("v1", "nodes", name=name)) is None
    assert kube.get_or_none(api_path("v1", "pods", namespace, "sleeper")) is None
    # The module's own real node, whose starter lives, was left running.
    assert node_ready(_node(kube, real_nodes.nodes[0].name))
    assert all(p.alive() for p in real_nodes.record.processes)
