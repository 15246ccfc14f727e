"""The operator's I/O edge on the real API server: exec-plugin and token-file kubeconfigs
with a token rotated (and the old one revoked) under a running operator, two replicas
electing one leader, and two gangs that cannot both fit applied at once."""

from __future__ import annotations

import base64
import contextlib
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from ringwright.devcluster.control_plane import Cluster
from ringwright.kube import (
    SERVICE_ACCOUNT_DIR_ENV,
    ApiError,
    KubeClient,
    api_path,
    load_kubeconfig,
    with_token,
)
from ringwright.operator.plan.manifests import JOB_LABEL
from tests.cluster.test_operator import wait_world
from tests.credentials import exec_calls, exec_user, kubeconfig
from tests.jobs import OperatorProcess, get_status, tj_path, training_job
from tests.waiting import wait_for

pytestmark = pytest.mark.cluster

RBAC = "rbac.authorization.k8s.io/v1"


@pytest.fixture()
def solo(operator: OperatorProcess) -> Iterator[None]:
    """The test runs operators of its own: the shared one stops meanwhile."""
    operator.stop()
    try:
        yield
    finally:
        operator.start()


def _cluster_stanza(cluster: Cluster) -> dict[str, Any]:
    doc = yaml.safe_load(cluster.kubeconfig.read_text())
    stanza: dict[str, Any] = doc["clusters"][0]["cluster"]
    return stanza


@pytest.fixture()
def admin_account(kube: KubeClient, namespace: str) -> Iterator[str]:
    """A ServiceAccount bound to cluster-admin, whose tokens can be revoked."""
    kube.create(api_path("v1", "serviceaccounts", namespace), {"metadata": {"name": "op"}})
    binding = f"{namespace}-op"
    kube.create(api_path(RBAC, "clusterrolebindings"), {
        "metadata": {"name": binding},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "cluster-admin"},
        "subjects": [{"kind": "ServiceAccount", "name": "op", "namespace": namespace}]})
    yield "op"
    kube.delete(api_path(RBAC, "clusterrolebindings", name=binding))


def bound_token(kube: KubeClient, namespace: str, account: str, secret: str) -> str:
    """A token of ``account`` that dies with Secret ``secret`` (deleting it revokes it)."""
    owner = kube.create(api_path("v1", "secrets", namespace), {"metadata": {"name": secret}})
    request = kube.create(api_path("v1", "serviceaccounts", namespace, account, "token"), {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {"expirationSeconds": 3600, "boundObjectRef": {
            "kind": "Secret", "apiVersion": "v1", "name": secret,
            "uid": owner["metadata"]["uid"]}}})
    token: str = request["status"]["token"]
    return token


def _refused(cluster: Cluster, token: str) -> bool:
    try:
        with KubeClient(with_token(load_kubeconfig(cluster.kubeconfig), token)) as client:
            client.get(api_path("v1", "namespaces"))
    except ApiError as err:
        return err.status == 401
    return False


def in_cluster(cluster: Cluster, sa_dir: Path, token: Path, namespace: str) -> dict[str, str]:
    """The environment and mounted files of a pod's in-cluster ServiceAccount, with the
    token at ``token`` (the kubelet's projected volume, here under ``sa_dir``)."""
    stanza = _cluster_stanza(cluster)
    sa_dir.mkdir(parents=True, exist_ok=True)
    ca = stanza.get("certificate-authority")
    (sa_dir / "ca.crt").write_bytes(Path(ca).read_bytes() if ca else
                                    base64.b64decode(stanza["certificate-authority-data"]))
    (sa_dir / "namespace").write_text(namespace)
    server = urlsplit(stanza["server"])
    return {"KUBECONFIG": "", "KUBERNETES_SERVICE_HOST": str(server.hostname),
            "KUBERNETES_SERVICE_PORT": str(server.port), SERVICE_ACCOUNT_DIR_ENV: str(sa_dir)}


@pytest.mark.parametrize("credential", ["exec-plugin", "token-file", "in-cluster"])
def test_a_rotated_token_keeps_the_operator_working(
    cluster: Cluster, kube: KubeClient, namespace: str, api: None, solo: None,
    admin_account: str, tmp_path: Path, credential: str,
) -> None:
    token = tmp_path / "sa" / "token"
    token.parent.mkdir()
    token.write_text(bound_token(kube, namespace, admin_account, "op-token-1"))
    env: dict[str, str] = {}
    config = None
    if credential == "in-cluster":
        # The path a pod's operator takes: the mounted ServiceAccount, rotated in place.
        env = in_cluster(cluster, token.parent, token, namespace)
    else:
        user = (exec_user(tmp_path, token) if credential == "exec-plugin"
                else {"tokenFile": str(token)})
        config = kubeconfig(tmp_path / "kubeconfig", _cluster_stanza(cluster), user, namespace)
    proc = OperatorProcess(cluster, tmp_path / "operator.log", kubeconfig=config, env=env)
    proc.start()
    try:
        kube.create(tj_path(namespace), training_job("rotate", replicas=2, minimum=1))
        first = wait_world(kube, namespace, "rotate", 2)
        calls = exec_calls(token)
        if credential == "exec-plugin":
            assert calls >= 1

        # Rotate: a new token in place, then the old one revoked.
        old = token.read_text()
        token.write_text(bound_token(kube, namespace, admin_account, "op-token-2"))
        kube.delete(api_path("v1", "secrets", namespace, "op-token-1"))
        wait_for(lambda: _refused(cluster, old), "the old token to be refused")

        kube.merge_patch(tj_path(namespace, "rotate", "scale"), {"spec": {"replicas": 3}})
        wait_world(kube, namespace, "rotate", 3, after=first.generation)
        if credential == "exec-plugin":
            assert exec_calls(token) > calls  # the plugin ran again for the new token
    except AssertionError as err:
        raise AssertionError(f"{err}\noperator log:\n{proc.tail(60)}") from err
    finally:
        proc.stop()


def _holder(kube: KubeClient, namespace: str) -> str:
    lease = kube.get_or_none(api_path("coordination.k8s.io/v1", "leases", namespace,
                                      "ringwright-operator"))
    return str(((lease or {}).get("spec") or {}).get("holderIdentity") or "")


@contextlib.contextmanager
def two_replicas(cluster: Cluster, namespace: str, tmp_path: Path,
                 args: Sequence[str] = ()) -> Iterator[tuple[OperatorProcess, OperatorProcess]]:
    """Two operator replicas whose Lease lives in ``namespace``: the first started and
    leading, the second standing by. Both logs' tails join a failed assertion; both stop
    after."""
    doc = yaml.safe_load(cluster.kubeconfig.read_text())
    doc["contexts"][0]["context"]["namespace"] = namespace  # the Lease lives here
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump(doc))
    first = OperatorProcess(cluster, tmp_path / "first.log", kubeconfig=config, args=args)
    second = OperatorProcess(cluster, tmp_path / "second.log", kubeconfig=config, args=args)
    first.start()
    try:
        wait_for(lambda: "leading as" in first.tail(), "the first replica to lead")
        second.start()
        wait_for(lambda: "standing by" in second.tail(), "the second replica to stand by")
        yield first, second
    except AssertionError as err:
        raise AssertionError(f"{err}\nfirst:\n{first.tail(30)}\nsecond:\n{second.tail(30)}"
                             ) from err
    finally:
        first.stop()
        second.stop()


def test_two_replicas_never_both_act(
    cluster: Cluster, kube: KubeClient, namespace: str, api: None, solo: None,
    tmp_path: Path,
) -> None:
    with two_replicas(cluster, namespace, tmp_path) as (first, second):
        kube.create(tj_path(namespace), training_job("led", replicas=2, minimum=1))
        before = wait_world(kube, namespace, "led", 2)
        standby = second.tail(500)
        assert "created pod" not in standby and "published world" not in standby
        assert "leading as" not in standby
        assert "Initial authentication" not in standby  # kopf never even started
        leader = _holder(kube, namespace)
        assert leader and leader in first.tail(500)

        first.kill()  # the leader dies without a word; the standby takes over
        wait_for(lambda: "leading as" in second.tail(), "the standby to take over",
                 timeout=30)
        assert _holder(kube, namespace) not in ("", leader)
        kube.merge_patch(tj_path(namespace, "led", "scale"), {"spec": {"replicas": 3}})
        wait_world(kube, namespace, "led", 3, after=before.generation)
        assert "created pod" in second.tail(500)


def test_a_leader_stopped_gracefully_hands_the_lease_on_at_once(
    cluster: Cluster, kube: KubeClient, namespace: str, api: None, solo: None,
    tmp_path: Path,
) -> None:
    # Leases of 10 minutes: the standby can only lead within the test's deadline if the
    # leader gives the Lease up when it stops (as a rollout's old replica does).
    with two_replicas(cluster, namespace, tmp_path, ["--lease-seconds", "600"]) as (
            first, second):
        leader = _holder(kube, namespace)
        first.stop()  # SIGTERM, as the kubelet stops a pod
        assert "released lease" in first.tail()
        wait_for(lambda: "leading as" in second.tail(), "the standby to take over", timeout=60)
        assert _holder(kube, namespace) not in ("", leader)
        kube.create(tj_path(namespace), training_job("handed", replicas=2, minimum=1))
        wait_world(kube, namespace, "handed", 2)


def test_two_gangs_that_cannot_both_fit_end_with_one_running_and_one_holding_no_node(
    cluster: Cluster, kube: KubeClient, namespace: str, operator: OperatorProcess,
    tmp_path: Path,
) -> None:
    # 64 H100s in the default inventory: each gang needs 40 of them, all or nothing.
    gangs = [training_job(name, replicas=5, minimum=5, gpusPerWorker=8,
                          gpuModel="NVIDIA-H100-80GB-HBM3") for name in ("gang-a", "gang-b")]
    kubectl = shutil.which("kubectl")
    if kubectl:
        manifest = tmp_path / "gangs.yaml"
        manifest.write_text(yaml.safe_dump_all(gangs))
        subprocess.run([kubectl, "--kubeconfig", str(cluster.kubeconfig), "-n", namespace,
                        "apply", "-f", str(manifest)], check=True, capture_output=True)
    else:
        for gang in gangs:
            kube.create(tj_path(namespace), gang)

    def phases() -> dict[str, str]:
        return {g["metadata"]["name"]: get_status(kube, namespace, g["metadata"]["name"])
                .get("phase", "") for g in gangs}

    running = wait_for(lambda: [n for n, p in phases().items() if p == "Running"],
                       "one gang Running")
    [winner] = running
    loser = "gang-b" if winner == "gang-a" else "gang-a"

    def loser_refused() -> bool:
        conds = get_status(kube, namespace, loser).get("conditions") or []
        return any(c["type"] == "Schedulable" and c["status"] == "False" for c in conds)

    wait_for(loser_refused, f"{loser} to be reported unschedulable")
    pods = kube.list(api_path("v1", "pods", namespace), labelSelector=f"{JOB_LABEL}={loser}")
    assert [p["spec"].get("nodeName") for p in pods if p["spec"].get("nodeName")] == []
    assert phases()[loser] == "Pending"
    winners = kube.list(api_path("v1", "pods", namespace), labelSelector=f"{JOB_LABEL}={winner}")
    assert len(winners) == 5 and all(p["spec"].get("nodeName") for p in winners)
