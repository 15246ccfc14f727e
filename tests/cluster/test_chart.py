"""The Helm chart on the local cluster: `helm install`, the objects it makes, the
operator's permissions exercised with its own ServiceAccount token, `helm uninstall`.

The cluster has no kubelet: KWOK binds the operator pod and reports it Running, but
no container runs, so nothing here waits for the operator to act.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from ringwright.devcluster.control_plane import Cluster, free_port
from ringwright.devcluster.helm import CHART, Helm
from ringwright.kube import ApiError, KubeClient, api_path, load_kubeconfig, with_token
from ringwright.objects import Obj
from ringwright.world import WORLD_KEY, parse_world, world_configmap_name
from tests.jobs import tj_path, training_job
from tests.unit.test_chart_notes import Target, check_notes
from tests.unit.test_chart_render import IN_CI
from tests.waiting import wait_for

pytestmark = pytest.mark.cluster

RBAC = "rbac.authorization.k8s.io/v1"
CRDS = ("trainingjobs.ringwright.dev", "schedulingpolicies.ringwright.dev")


@dataclasses.dataclass(frozen=True)
class Release:
    name: str
    namespace: str
    fullname: str
    values: Obj
    install_output: str

    @property
    def classes(self) -> tuple[str, str]:
        pcs = self.values["priorityClasses"]
        return pcs["ps"]["name"], pcs["worker"]["name"]

    @property
    def policy(self) -> str:
        name: str = self.values["schedulingPolicy"]["name"]
        return name


def _helm(cluster: Cluster, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    helm = Helm.find(cluster.kubeconfig, tmp)
    if helm is None:
        message = "no helm binary: run `python -m ringwright.devcluster build`"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return helm.run(*args)


@contextlib.contextmanager
def _install(cluster: Cluster, kube: KubeClient, namespace: str, tmp: Path,
             watch_namespaces: list[str]) -> Iterator[Release]:
    """`helm install` into ``namespace``; `helm uninstall --wait` on the way out."""
    # Cluster-scoped names carry the test namespace: other tests of this run may
    # own a `default` SchedulingPolicy or the default PriorityClasses, and helm
    # refuses to adopt objects it did not create. The default names themselves are
    # checked by the unit tests of the rendered chart.
    name = f"rw-{namespace}"
    values: Obj = {
        "priorityClasses": {"ps": {"name": f"{namespace}-ps"},
                            "worker": {"name": f"{namespace}-worker"}},
        "schedulingPolicy": {"name": f"{namespace}-policy"},
        "operator": {"watchNamespaces": watch_namespaces},
    }
    (tmp / "values.yaml").write_text(yaml.safe_dump(values))
    # The operator pod must pass the strictest Pod Security Standard.
    kube.merge_patch(api_path("v1", "namespaces", name=namespace), {"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": "restricted"}}})
    proc = _helm(cluster, tmp, "install", name, str(CHART), "--namespace", namespace,
                 "--values", str(tmp / "values.yaml"), "--timeout", "2m")
    assert proc.returncode == 0, f"helm install failed:\n{proc.stderr}"
    try:
        for crd in CRDS:
            _wait_served(kube, crd)
        yield Release(name, namespace, f"{name}-ringwright", values, proc.stdout)
    finally:
        out = _helm(cluster, tmp, "uninstall", name, "--namespace", namespace, "--wait",
                    "--timeout", "2m")
        assert out.returncode == 0, f"helm uninstall failed:\n{out.stderr}"


@pytest.fixture()
def release(cluster: Cluster, kube: KubeClient, namespace: str,
            tmp_path: Path) -> Iterator[Release]:
    """The chart installed to serve every namespace."""
    with _install(cluster, kube, namespace, tmp_path, []) as installed:
        yield installed


def _established(kube: KubeClient, crd: str) -> bool:
    obj = kube.get_or_none(api_path("apiextensions.k8s.io/v1", "customresourcedefinitions",
                                    name=crd))
    conditions = (obj or {}).get("status", {}).get("conditions", [])
    return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)


def _serves(kube: KubeClient, crd: str) -> bool:
    if not _established(kube, crd):
        return False
    plural, group = crd.split(".", 1)
    try:
        kube.list(api_path(f"{group}/v1alpha1", plural))
    except ApiError as err:
        # A CRD that has just been created answers 429 while its storage starts.
        if err.status == 429:
            return False
        raise
    return True


def _wait_served(kube: KubeClient, crd: str) -> None:
    wait_for(lambda: _serves(kube, crd), f"CRD {crd} to be established and served")


def _operator_token(kube: KubeClient, release: Release) -> str:
    """A token of the operator's own ServiceAccount, as the kubelet would mount it."""
    request = kube.create(
        api_path("v1", "serviceaccounts", release.namespace, release.fullname, "token"),
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
         "spec": {"expirationSeconds": 3600}})
    token: str = request["status"]["token"]
    return token


def _as_operator(cluster: Cluster, kube: KubeClient, release: Release) -> KubeClient:
    """A client that authenticates as the operator's ServiceAccount."""
    admin = load_kubeconfig(cluster.kubeconfig)
    return KubeClient(with_token(admin, _operator_token(kube, release)))


def _forbidden(call: Callable[..., object], *args: Any) -> bool:
    try:
        call(*args)
    except ApiError as err:
        if err.status == 403:
            return True
        raise
    return False


def test_install_creates_crds_operator_rbac_priority_classes_and_policy(
    cluster: Cluster, kube: KubeClient, release: Release
) -> None:
    for crd in CRDS:
        assert _established(kube, crd)
    ns, full = release.namespace, release.fullname

    deployment = kube.get(api_path("apps/v1", "deployments", ns, full))
    assert deployment["spec"]["replicas"] == 2
    pdb = kube.get(api_path("policy/v1", "poddisruptionbudgets", ns, full))
    assert pdb["spec"]["minAvailable"] == 1
    pod_spec = deployment["spec"]["template"]["spec"]
    assert pod_spec["serviceAccountName"] == full
    assert kube.get_or_none(api_path("v1", "serviceaccounts", ns, full)) is not None
    # The ReplicaSet could create the pod in a `restricted` namespace: it passed
    # Pod Security admission. KWOK then binds it; no container runs.
    labels = deployment["spec"]["selector"]["matchLabels"]
    selector = ",".join(f"{k}={v}" for k, v in labels.items())
    pods = wait_for(lambda: kube.list(api_path("v1", "pods", ns), labelSelector=selector),
                    "the operator pod to be created")
    pod = pods[0]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True

    for suffix in ("cluster", "jobs"):
        assert kube.get_or_none(api_path(RBAC, "clusterroles", name=f"{full}-{suffix}"))
        binding = kube.get(api_path(RBAC, "clusterrolebindings", name=f"{full}-{suffix}"))
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": full, "namespace": ns}]

    ps_name, worker_name = release.classes
    ps = kube.get(api_path("scheduling.k8s.io/v1", "priorityclasses", name=ps_name))
    worker = kube.get(api_path("scheduling.k8s.io/v1", "priorityclasses", name=worker_name))
    assert ps["value"] > worker["value"]
    # Workers never evict other workloads; ps pods may evict lower-priority pods.
    assert worker["preemptionPolicy"] == "Never"
    assert ps["preemptionPolicy"] == "PreemptLowerPriority"

    # The API server accepted the policy through the CRD's schema and CEL rules.
    policy = kube.get(api_path("ringwright.dev/v1alpha1", "schedulingpolicies",
                               name=release.policy))
    assert policy["spec"]["priorityClasses"] == {"ps": ps_name, "worker": worker_name}
    assert policy["spec"]["rackPacking"] == "Required"

    assert "kubectl get tj" in release.install_output


_PATHS = {"Deployment": ("apps/v1", "deployments"),
          "SchedulingPolicy": ("ringwright.dev/v1alpha1", "schedulingpolicies")}


def test_install_notes_name_live_objects(kube: KubeClient, release: Release) -> None:
    """The commands `helm install` printed name what the install made."""
    _, found, notes = release.install_output.partition("\nNOTES:\n")
    assert found, release.install_output
    deployment = kube.get(api_path("apps/v1", "deployments", release.namespace,
                                   release.fullname))
    policy = kube.get(api_path(*_PATHS["SchedulingPolicy"], name=release.policy))

    def exists(kind: str, namespace: str | None, name: str) -> bool:
        version, plural = _PATHS[kind]
        return kube.get_or_none(api_path(version, plural, namespace, name)) is not None

    crds = [kube.get(api_path("apiextensions.k8s.io/v1", "customresourcedefinitions",
                              name=crd)) for crd in CRDS]
    commands = check_notes(notes, Target([deployment, policy], crds, [], exists))
    [logs] = [c for c in commands if c.args[:1] == ["logs"]]
    pods = wait_for(lambda: kube.list(api_path("v1", "pods", logs.options["n"]),
                                      labelSelector=logs.options["l"]),
                    "the operator pods the logs command selects")
    assert {p["metadata"]["namespace"] for p in pods} == {release.namespace}


def test_operator_token_can_do_its_work_and_nothing_more(
    cluster: Cluster, kube: KubeClient, release: Release
) -> None:
    ns = release.namespace
    with _as_operator(cluster, kube, release) as op:
        op.list(api_path("ringwright.dev/v1alpha1", "trainingjobs"))  # every namespace
        op.list(api_path("ringwright.dev/v1alpha1", "schedulingpolicies"))
        op.list(api_path("v1", "nodes"))
        op.list(api_path("v1", "pods", "default"))
        assert _forbidden(op.list, api_path("v1", "secrets", ns))
        assert _forbidden(op.get, api_path("v1", "secrets", "kube-system", "anything"))
        assert _forbidden(op.list, api_path("v1", "namespaces"))  # not needed for all namespaces

        # What the operator does for each job: a ServiceAccount, and a Role that lets
        # the job's pods read the world and patch the reports, bound to it. RBAC lets
        # it create that Role only because it holds those verbs itself.
        op.create(api_path("v1", "serviceaccounts", ns), {"metadata": {"name": "job-a"}})
        op.create(api_path(RBAC, "roles", ns), {"metadata": {"name": "job-a"}, "rules": [
            {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["job-a-world"],
             "verbs": ["get", "list", "watch"]},
            {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["job-a-reports"],
             "verbs": ["patch"]}]})
        op.create(api_path(RBAC, "rolebindings", ns), {
            "metadata": {"name": "job-a"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                        "name": "job-a"},
            "subjects": [{"kind": "ServiceAccount", "name": "job-a", "namespace": ns}]})
        # Granting what it does not hold is an escalation the API server refuses.
        assert _forbidden(op.create, api_path(RBAC, "roles", ns), {
            "metadata": {"name": "sneaky"},
            "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]})


def test_namespace_list_confines_the_operator_to_those_namespaces(
    cluster: Cluster, kube: KubeClient, namespace: str, tmp_path: Path
) -> None:
    with _install(cluster, kube, namespace, tmp_path, [namespace]) as release:
        binding = kube.get(api_path(RBAC, "rolebindings", namespace, f"{release.fullname}-jobs"))
        assert binding["roleRef"]["kind"] == "Role"
        assert kube.get_or_none(
            api_path(RBAC, "clusterrolebindings", name=f"{release.fullname}-jobs")) is None
        with _as_operator(cluster, kube, release) as op:
            op.list(api_path("ringwright.dev/v1alpha1", "trainingjobs", namespace))
            op.list(api_path("v1", "configmaps", namespace))
            op.list(api_path("v1", "namespaces"))  # kopf follows the watched namespaces
            op.list(api_path("v1", "pods", namespace))  # node capacity: the watched pods
            assert _forbidden(op.list, api_path("v1", "pods"))
            assert _forbidden(op.list, api_path("ringwright.dev/v1alpha1", "trainingjobs"))
            assert _forbidden(op.list, api_path("v1", "configmaps", "default"))
            assert _forbidden(op.create, api_path(RBAC, "roles", "default"),
                              {"metadata": {"name": "x"}, "rules": []})


def test_uninstall_removes_the_release_and_keeps_the_crds(
    cluster: Cluster, kube: KubeClient, namespace: str, tmp_path: Path
) -> None:
    with _install(cluster, kube, namespace, tmp_path, []) as release:
        full = release.fullname
        assert kube.get_or_none(api_path("apps/v1", "deployments", namespace, full))
    # Leaving the block ran `helm uninstall --wait`.
    assert kube.get_or_none(api_path("apps/v1", "deployments", namespace, full)) is None
    assert kube.get_or_none(api_path(RBAC, "clusterroles", name=f"{full}-jobs")) is None
    for pc in release.classes:
        assert kube.get_or_none(api_path("scheduling.k8s.io/v1", "priorityclasses", name=pc)) \
            is None
    assert kube.get_or_none(api_path("ringwright.dev/v1alpha1", "schedulingpolicies",
                                     name=release.policy)) is None
    # Helm never deletes CRDs: deleting them would delete every TrainingJob with them.
    for crd in CRDS:
        assert _established(kube, crd), f"{crd} was removed"


@contextlib.contextmanager
def _extra_namespace(kube: KubeClient) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:10]}"
    kube.create(api_path("v1", "namespaces"), {"metadata": {"name": name}})
    try:
        yield name
    finally:
        kube.delete(api_path("v1", "namespaces", name=name))


def _healthy(port: int, proc: subprocess.Popen[bytes], log: Path) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"the operator exited with {proc.returncode}:\n"
                             f"{log.read_text(errors='replace')[-4000:]}")
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_operator_works_with_only_the_charts_permissions(
    cluster: Cluster, kube: KubeClient, namespace: str, tmp_path: Path
) -> None:
    """Run the real operator, with the Deployment's arguments, as its ServiceAccount.

    The operator serves a second namespace (its pods there need not pass the
    `restricted` profile), reconciles a job placed by the release's own policy and
    PriorityClasses, and must never meet a 403 on the way.
    """
    with _extra_namespace(kube) as jobs_ns, \
            _install(cluster, kube, namespace, tmp_path, [jobs_ns]) as release:
        kubeconfig = yaml.safe_load(cluster.kubeconfig.read_text())
        for user in kubeconfig["users"]:
            user["user"] = {"token": _operator_token(kube, release)}
        (tmp_path / "operator.kubeconfig").write_text(yaml.safe_dump(kubeconfig))
        deployment = kube.get(api_path("apps/v1", "deployments", namespace, release.fullname))
        main = deployment["spec"]["template"]["spec"]["containers"][0]
        port = free_port()
        args = [a.replace("http://0.0.0.0:8080/", f"http://127.0.0.1:{port}/")
                for a in main["args"]]
        assert f"--namespace={jobs_ns}" in args
        log = tmp_path / "operator.log"
        # What the Deployment's downward API gives the pod: the Lease's namespace.
        env = {**os.environ, "KUBECONFIG": str(tmp_path / "operator.kubeconfig"),
               "POD_NAMESPACE": namespace}
        with log.open("wb") as out:
            # cwd: the checkout's operator/ folder must not shadow the standard library.
            proc = subprocess.Popen([sys.executable, *main["command"][1:], *args], cwd=tmp_path,
                                    env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: _healthy(port, proc, log), "the operator's /healthz", timeout=60)
            job = training_job("chart-job", replicas=2, minimum=1,
                               schedulingPolicyName=release.policy)
            kube.create(tj_path(jobs_ns), job)

            def world_size() -> int | None:
                _healthy(port, proc, log)
                cm = kube.get_or_none(api_path("v1", "configmaps", jobs_ns,
                                               world_configmap_name("chart-job")))
                text = ((cm or {}).get("data") or {}).get(WORLD_KEY)
                return parse_world(text).size if text else None

            try:
                size = wait_for(world_size, "the operator to publish the job's world")
            except AssertionError as err:
                raise AssertionError(f"{err}\noperator log:\n"
                                     f"{log.read_text(errors='replace')[-6000:]}") from None
            assert size == 2
            pods = kube.list(api_path("v1", "pods", jobs_ns))
            assert {p["spec"].get("priorityClassName") for p in pods} == {release.classes[1]}
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            kube.delete(tj_path(jobs_ns, "chart-job"))
        text = log.read_text(errors="replace")
        refusal = re.compile(r"HTTP/1\.1 403|\b403 Forbidden\b| is forbidden: |"
                             r"Not enough permissions")
        denied = [line for line in text.splitlines() if refusal.search(line)]
        assert not denied, "the chart's RBAC refused the operator:\n" + "\n".join(denied[:20])
