"""Job isolation against the real API server: join token, NetworkPolicy, template limits,
least privilege. (KWOK has no network plane: the NetworkPolicy is checked as an object.)"""

from __future__ import annotations

import base64
from typing import Any

import pytest

from ringwright.kube import KubeClient, api_path
from ringwright.operator.isolation import JOIN_TOKEN_DIR
from ringwright.operator.manifests import JOB_LABEL
from ringwright.world import Env
from tests.cluster.test_operator import wait_world
from tests.jobs import OperatorProcess, tj_path, training_job
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
