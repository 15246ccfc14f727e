"""Job isolation against the real API server: join token, NetworkPolicy, template limits,
least privilege. (KWOK has no network plane: the NetworkPolicy is checked as an object.)"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ringwright.devcluster.control_plane import Cluster
from ringwright.kube import ApiError, KubeClient, api_path, load_kubeconfig, with_token
from ringwright.operator.plan.isolation import JOIN_TOKEN_DIR, report_key
from ringwright.operator.plan.manifests import JOB_LABEL
from ringwright.report_seal import seal
from ringwright.world import Env, Report, ReportKind, reports_configmap_name
from tests.cluster.test_chart import _install
from tests.cluster.test_operator import wait_world
from tests.jobs import OperatorProcess, fresh_namespace, reconciled, tj_path, training_job
from tests.waiting import wait_for

pytestmark = pytest.mark.cluster


def test_each_job_gets_its_own_token_mounted_in_its_pods_and_a_network_policy(
    kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    for name in ("iso-a", "iso-b"):
        kube.create(tj_path(namespace), training_job(name, replicas=2, minimum=1))
    tokens = {}
    for name in ("iso-a", "iso-b"):
        wait_world(kube, namespace, name, 2)
        job_uid = kube.get(tj_path(namespace, name))["metadata"]["uid"]
        secret = kube.get(api_path("v1", "secrets", namespace, f"{name}-join-token"))
        assert secret["metadata"]["ownerReferences"][0]["uid"] == job_uid
        tokens[name] = base64.b64decode(secret["data"]["token"])
        assert len(tokens[name]) >= 43
        pods: list[dict[str, Any]] = kube.list(api_path("v1", "pods", namespace),
                                               labelSelector=f"{JOB_LABEL}={name}")
        for pod in pods:
            volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
            assert volumes["ringwright-join-token"]["secret"]["secretName"] == \
                f"{name}-join-token"
            train = pod["spec"]["containers"][0]
            assert {m["mountPath"] for m in train["volumeMounts"]} >= {JOIN_TOKEN_DIR}
            env = {e["name"]: e.get("value") for e in train["env"]}
            assert env[Env.JOIN_TOKEN_FILE] == f"{JOIN_TOKEN_DIR}/token"
        policy = kube.get(api_path("networking.k8s.io/v1", "networkpolicies", namespace, name))
        assert policy["metadata"]["ownerReferences"][0]["uid"] == job_uid
        assert policy["spec"]["podSelector"] == {"matchLabels": {JOB_LABEL: name}}
        assert policy["spec"]["ingress"][0] == {
            "from": [{"podSelector": {"matchLabels": {JOB_LABEL: name}}}]}
    assert tokens["iso-a"] != tokens["iso-b"]
    # The token outlives scaffold re-applies: it is never rewritten under running members.
    first = kube.get(api_path("v1", "secrets", namespace, "iso-a-join-token"))
    kube.merge_patch(tj_path(namespace, "iso-a"), {"spec": {"workers": {"replicas": 3}}})
    wait_world(kube, namespace, "iso-a", 3)
    again = kube.get(api_path("v1", "secrets", namespace, "iso-a-join-token"))
    assert again["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
    # Deleting the job takes its Secret and NetworkPolicy with it (owner references).
    kube.delete(tj_path(namespace, "iso-b"))
    wait_for(lambda: kube.get_or_none(api_path("v1", "secrets", namespace,
                                               "iso-b-join-token")) is None,
             "iso-b's token collected", timeout=60)


def test_a_template_beyond_the_policy_creates_no_pod_and_names_the_field(
    kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    job = training_job("too-much", replicas=2, minimum=1)
    template = job["spec"]["workers"]["template"]["spec"]
    template["hostNetwork"] = True
    template["containers"][0]["securityContext"] = {"privileged": True}
    kube.create(tj_path(namespace), job)
    cond = wait_for(lambda: next((c for c in (kube.get(tj_path(namespace, "too-much"))
                                              .get("status") or {}).get("conditions") or []
                                  if c["type"] == "TemplateAllowed"), None),
                    "the TemplateAllowed condition")
    assert cond["status"] == "False" and cond["reason"] == "TemplateRefused"
    assert "spec.workers.template.spec.hostNetwork is true (allowHostNetwork)" in cond["message"]
    assert "containers[0].securityContext.privileged" in cond["message"]
    events = kube.list(api_path("v1", "events", namespace),
                       fieldSelector="involvedObject.name=too-much")
    assert any(e["reason"] == "TemplateRefused" and e["type"] == "Warning" and
               "hostNetwork" in e["message"] for e in events)
    assert kube.list(api_path("v1", "pods", namespace),
                     labelSelector=f"{JOB_LABEL}=too-much") == []


def test_pods_run_with_the_default_security_context(
    kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    kube.create(tj_path(namespace), training_job("hardened", replicas=1, minimum=1))
    wait_world(kube, namespace, "hardened", 1)
    [pod] = kube.list(api_path("v1", "pods", namespace), labelSelector=f"{JOB_LABEL}=hardened")
    assert pod["spec"]["containers"][0]["securityContext"] == {
        "runAsNonRoot": True, "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def _as_job_pods(cluster: Cluster, kube: KubeClient, namespace: str, job: str) -> KubeClient:
    """A client with a token of the job's pods' ServiceAccount, as the kubelet mounts it."""
    token = kube.create(api_path("v1", "serviceaccounts", namespace, f"{job}-runtime", "token"),
                        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                         "spec": {"expirationSeconds": 600}})["status"]["token"]
    return KubeClient(with_token(load_kubeconfig(cluster.kubeconfig), token))


def test_one_member_forging_its_peers_reports_evicts_nobody(
    cluster: Cluster, kube: KubeClient, namespace: str, operator: OperatorProcess
) -> None:
    job = "reports"
    kube.create(tj_path(namespace), training_job(job, replicas=3, minimum=1))
    world = wait_world(kube, namespace, job, 3)
    pods = {p["metadata"]["name"]: p for p in kube.list(
        api_path("v1", "pods", namespace), labelSelector=f"{JOB_LABEL}={job}")}
    keys = {name: report_key(p) for name, p in pods.items()}
    assert all(keys.values()) and len(set(keys.values())) == 3
    w0, w1, w2 = (m.pod for m in world.members)
    victim_uid = pods[w2]["metadata"]["uid"]
    path = api_path("v1", "configmaps", namespace, reports_configmap_name(job))
    dead = Report(kind=ReportKind.PEER_DEAD, generation=world.generation, at=time.time(),
                  suspects=(w2,))
    stalled = Report(kind=ReportKind.STALLED, generation=world.generation, at=time.time())
    with _as_job_pods(cluster, kube, namespace, job) as member:
        # A member cannot read the reports (nor others' seals) ...
        with pytest.raises(ApiError) as refused:
            member.get(path)
        assert refused.value.status == 403
        # ... but may patch them: w0, knowing only its own key, names the healthy w2
        # dead in its own name and in w1's, and says w2 stalled in w2's name.
        member.merge_patch(path, {"data": {
            w0: seal(w0, dead, keys[w0] or "").to_json(),
            w1: seal(w1, dead, keys[w0] or "").to_json(),
            w2: seal(w2, stalled, keys[w0] or "").to_json()}})
        wait_for(lambda: f"ignoring a report under {w2}'s name" in operator.log.read_text(),
                 "the operator to refuse the forged reports")
        # A round that began after the refusal has been applied: nobody was evicted.
        reconciled(kube, namespace, job)
        assert wait_world(kube, namespace, job, 3).generation == world.generation
        assert kube.get(api_path("v1", "pods", namespace, w2))["metadata"]["uid"] == victim_uid
        reasons = [e["reason"] for e in kube.list(api_path("v1", "events", namespace),
                                                 fieldSelector=f"involvedObject.name={job}")]
        assert "MemberDead" not in reasons and "MemberStalled" not in reasons
        # The same report, sealed by w1 itself, corroborates w0's: w2 is replaced.
        member.merge_patch(path, {"data": {w1: seal(w1, dead, keys[w1] or "").to_json()}})
    wait_for(lambda: "MemberDead" in [
        e["reason"] for e in kube.list(api_path("v1", "events", namespace),
                                       fieldSelector=f"involvedObject.name={job}")],
             "w2 evicted on two honest reports")


def can_i(kube: KubeClient, user: str, verb: str, resource: str, namespace: str = "",
          *, group: str = "", subresource: str = "", name: str = "") -> bool:
    """What ``kubectl auth can-i VERB RESOURCE --as USER`` answers, asked of the API
    server by the same review (a SubjectAccessReview), without needing kubectl."""
    attributes = {"verb": verb, "resource": resource, "group": group,
                  "subresource": subresource, "namespace": namespace, "name": name}
    review = kube.create(api_path("authorization.k8s.io/v1", "subjectaccessreviews"), {
        "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
        "spec": {"user": user, "groups": ["system:serviceaccounts", "system:authenticated"],
                 "resourceAttributes": {k: v for k, v in attributes.items() if v}}})
    return bool(review["status"].get("allowed"))


@pytest.fixture()
def other_namespace(kube: KubeClient) -> Iterator[str]:
    with fresh_namespace(kube) as name:
        yield name


@pytest.mark.parametrize("mode", ["all-namespaces", "namespaced"])
def test_the_charts_operator_account_holds_least_privilege(
    cluster: Cluster, kube: KubeClient, namespace: str, other_namespace: str,
    tmp_path: Path, mode: str,
) -> None:
    """Audit the installed chart's RBAC, as `kubectl auth can-i --as` would."""
    served = [namespace] if mode == "namespaced" else []
    with _install(cluster, kube, namespace, tmp_path, served) as release:
        op = f"system:serviceaccount:{namespace}:{release.fullname}"

        def can(verb: str, resource: str, ns: str = "", **kw: str) -> bool:
            return can_i(kube, op, verb, resource, ns, **kw)

        # What it does for a job in a served namespace.
        for verb, resource in (("create", "pods"), ("delete", "pods"), ("patch", "configmaps"),
                               ("watch", "configmaps"), ("create", "secrets"),
                               ("list", "pods")):
            assert can(verb, resource, namespace), (verb, resource)
        assert can("create", "networkpolicies", namespace, group="networking.k8s.io")
        # Secrets: it creates the join tokens and can read none, not even its own.
        for verb in ("get", "list", "watch", "update", "patch", "delete"):
            assert not can(verb, "secrets", namespace), verb
            assert not can(verb, "secrets", namespace, name="job-join-token"), verb
            assert not can(verb, "secrets", "kube-system"), verb
        # No way into a container, no way around RBAC.
        for sub in ("exec", "attach", "portforward"):
            assert not can("create", "pods", namespace, subresource=sub), sub
            assert not can("get", "pods", namespace, subresource=sub), sub
        assert not can("impersonate", "serviceaccounts", namespace)
        assert not can("bind", "roles", namespace, group="rbac.authorization.k8s.io")
        assert not can("escalate", "roles", namespace, group="rbac.authorization.k8s.io")
        assert not can("create", "serviceaccounts", namespace, subresource="token")
        assert not can("patch", "nodes")
        # Verbs nothing uses are gone.
        assert not can("update", "configmaps", namespace)
        assert not can("delete", "configmaps", namespace)
        assert not can("update", "trainingjobs", namespace, group="ringwright.dev")
        assert not can("patch", "trainingjobs", namespace, group="ringwright.dev",
                       subresource="scale")
        elsewhere = other_namespace
        if mode == "namespaced":
            # Nothing namespaced outside the served namespaces, and no pod read
            # cluster-wide.
            for verb, resource in (("create", "pods"), ("list", "pods"), ("list", "configmaps"),
                                   ("create", "secrets"), ("create", "configmaps")):
                assert not can(verb, resource, elsewhere), (verb, resource)
            assert not can("list", "trainingjobs", elsewhere, group="ringwright.dev")
            assert not can("list", "pods")
            assert not can("list", "trainingjobs", group="ringwright.dev")
        else:
            assert can("create", "pods", elsewhere) and can("list", "pods")
