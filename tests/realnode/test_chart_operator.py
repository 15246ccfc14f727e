"""`helm install` of the chart onto real nodes, as a user runs it: the operator image
as the chart's Deployment (two replicas electing a leader through a Lease, the chart's
ServiceAccount and RBAC, its metrics Service, a read-only root filesystem, non-root),
the image already in the nodes' containerd (the chart's IfNotPresent never pulls it).
Deleting the leader's pod: it releases the Lease on its way out and a live replica takes
it at once (no waiting out the lease), while the other stands by."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import httpx
import pytest
import yaml

from ringwright.devcluster.control_plane import Cluster
from ringwright.devcluster.helm import CHART, Helm
from ringwright.devcluster.realnode import REAL_NODE_LABEL, RealNodeSet
from ringwright.kube import ApiError, KubeClient, api_path
from ringwright.objects import Obj
from tests.conftest import IN_CI
from tests.waiting import wait_for
from tests.xdist_groups import REALNODE_GROUP

# 30 min like the other image modules: on a cold run this module's setup waits for the
# image lane to build the operator image from nothing (the builds take turns).
pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group(REALNODE_GROUP),
              pytest.mark.timeout(1800)]

NODE_IMAGES = ("operator",)
"""The image the nodes start with (tests/realnode/conftest.py)."""
LEASE = "ringwright-operator"
"""The operator's default Lease name (the chart sets none)."""
OPERATOR_SELECTOR = "app.kubernetes.io/component=operator"


def _helm(cluster: Cluster, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    helm = Helm.find(cluster.kubeconfig, tmp)
    if helm is None:
        message = "no helm binary: run `make binaries`"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return helm.run(*args)


def real_node_values(namespace: str) -> Obj:
    """What a user sets to put the operator on the real nodes: their taint tolerated,
    their label selected. Cluster-scoped names carry the namespace (other tests own the
    default PriorityClasses and SchedulingPolicy; helm adopts nothing), and the operator
    serves only its own namespace (the run's shared operator serves the others)."""
    return {
        "priorityClasses": {"ps": {"name": f"{namespace}-ps"},
                            "worker": {"name": f"{namespace}-worker"}},
        "schedulingPolicy": {"name": f"{namespace}-policy"},
        "operator": {
            "watchNamespaces": [namespace],
            "nodeSelector": {REAL_NODE_LABEL: "true"},
            "tolerations": [{"key": REAL_NODE_LABEL, "operator": "Exists",
                             "effect": "NoSchedule"}],
        },
    }


@pytest.fixture()
def release(cluster: Cluster, kube: KubeClient, namespace: str, tmp_path: Path,
            real_nodes: RealNodeSet, operator_image: str) -> Iterator[str]:
    """The chart installed into ``namespace``; its full name. Uninstalled after."""
    name = f"rw-{namespace}"
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(real_node_values(namespace)))
    kube.merge_patch(api_path("v1", "namespaces", name=namespace), {"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": "restricted"}}})
    proc = _helm(cluster, tmp_path, "install", name, str(CHART), "--namespace", namespace,
                 "--values", str(tmp_path / "values.yaml"), "--timeout", "2m")
    assert proc.returncode == 0, f"helm install failed:\n{proc.stderr}"
    try:
        yield f"{name}-ringwright"
    finally:
        out = _helm(cluster, tmp_path, "uninstall", name, "--namespace", namespace, "--wait",
                    "--timeout", "2m")
        assert out.returncode == 0, f"helm uninstall failed:\n{out.stderr}"


def _ready(pod: Obj) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in pod.get("status", {}).get("conditions", []))


def _operator_pods(kube: KubeClient, namespace: str) -> list[Obj]:
    return [p for p in kube.list(api_path("v1", "pods", namespace),
                                 labelSelector=OPERATOR_SELECTOR)
            if not p["metadata"].get("deletionTimestamp")]


def _holder(kube: KubeClient, namespace: str) -> str:
    lease = kube.get_or_none(api_path("coordination.k8s.io/v1", "leases", namespace, LEASE))
    return str(((lease or {}).get("spec") or {}).get("holderIdentity") or "")


def _pod_holding(pods: list[Obj], holder: str) -> Obj | None:
    """The pod whose operator holds the Lease (its identity starts with the host name,
    which is the pod's name)."""
    return next((p for p in pods if holder.startswith(p["metadata"]["name"] + "-")), None)


class _LineReader:
    """Every line a process writes to its stdout, read by a thread as it comes."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(process,), daemon=True)
        self._thread.start()

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self.lines.append(line)

    def text(self) -> str:
        """All of it, once the process has exited and its output is read to the end."""
        self._thread.join(timeout=30)
        return "".join(self.lines)


def test_the_charts_operator_runs_on_real_nodes_and_a_standby_takes_over(
    cluster: Cluster, kube: KubeClient, namespace: str, real_nodes: RealNodeSet, release: str,
) -> None:
    def two_ready() -> list[Obj] | None:
        pods = _operator_pods(kube, namespace)
        return pods if len(pods) == 2 and all(map(_ready, pods)) else None

    pods = wait_for(two_ready, "both operator replicas to be Ready", timeout=240)
    assert {p["spec"]["nodeName"] for p in pods} <= set(real_nodes.names)
    for pod in pods:
        assert pod["spec"]["serviceAccountName"] == release
        (container,) = pod["spec"]["containers"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        assert container["imagePullPolicy"] == "IfNotPresent"
        assert pod["status"]["containerStatuses"][0]["restartCount"] == 0

    leader = wait_for(lambda: _pod_holding(pods, _holder(kube, namespace)),
                      "one replica to take the Lease", timeout=120)

    # The metrics Service's endpoints are the replicas, and each serves its metrics
    # (the host routes to pod addresses, as a Prometheus in the cluster would reach them).
    def endpoint_ips() -> set[str] | None:
        ep = kube.get_or_none(api_path("v1", "endpoints", namespace, f"{release}-metrics"))
        ips = {a["ip"] for s in (ep or {}).get("subsets") or [] for a in s.get("addresses", [])}
        return ips if len(ips) == 2 else None

    ips = wait_for(endpoint_ips, "the metrics Service to list both replicas", timeout=60)
    assert ips == {p["status"]["podIP"] for p in pods}
    for ip in sorted(ips):
        body = httpx.get(f"http://{ip}:9400/metrics", timeout=10).text
        assert "ringwright_" in body

    # What the leader says on its way out: the stream ends when its container does. It
    # must be streaming before the delete: a kubectl still starting when the pod is gone
    # gets NotFound.
    leader_name = leader["metadata"]["name"]
    leader_log = subprocess.Popen(
        ["kubectl", "--kubeconfig", str(cluster.kubeconfig), "--namespace", namespace,
         "logs", "--follow", leader_name],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stream = _LineReader(leader_log)
    try:
        wait_for(lambda: stream.lines, "the leader's log to stream", timeout=120)
        before = _holder(kube, namespace)
        kube.delete(api_path("v1", "pods", namespace, leader_name))

        def new_holder() -> str | None:
            holder = _holder(kube, namespace)
            return holder if holder and holder != before else None

        # The released Lease goes to whichever live replica asks first: the standby, or
        # the Deployment's replacement for the deleted pod when that one is up by then.
        holder = wait_for(new_holder, f"a replica to take the Lease from {before}",
                          timeout=180)
        leader_log.wait(timeout=120)
        said = stream.text()
    finally:
        leader_log.kill()
    assert f"released lease {namespace}/{LEASE}" in said, (
        f"the deleted leader did not release the Lease on its way out:\n{said[-4000:]}")
    live = _operator_pods(kube, namespace)
    (leading,) = [p for p in live if _pod_holding([p], holder)]
    assert leading["metadata"]["name"] != leader_name
    def log_of(pod: Obj) -> str:
        try:
            return kube.get_text(api_path("v1", "pods", namespace, pod["metadata"]["name"],
                                          subresource="log"))
        except ApiError:
            return ""  # the replacement's container has not started: it cannot lead

    for pod in live:
        if pod is leading:
            # The Lease is written before the line is logged (and read through the
            # kubelet): the line may come a moment after the Lease.
            wait_for(partial(_says, log_of, pod, f"leading as {holder}"),
                     f"{holder} to log that it leads", timeout=60)
        else:
            log = log_of(pod)
            # Never two leaders: the other replica still stands by.
            assert "leading as" not in log, log[-4000:]


def _says(log_of: Callable[[Obj], str], pod: Obj, line: str) -> bool:
    return line in log_of(pod)
