"""Template limits: what a job's pod templates may ask for, and the default securityContext."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from ringwright.objects import Obj
from ringwright.operator.api.schedulingpolicy import SchedulingPolicySpec
from ringwright.operator.api.templates_policy import (
    TemplateLimits,
    default_security_context,
    job_violations,
    violations,
)
from ringwright.operator.plan.isolation import harden
from ringwright.operator.plan.manifests import pod
from tests.unit.operator.test_reconcile import job, run

WHERE = "spec.workers.template.spec"
BASE: Obj = {"containers": [{"name": "train", "image": "img"}]}


def with_(**fields: Any) -> Obj:
    return {**copy.deepcopy(BASE), **fields}


def container_sc(**sc: Any) -> Obj:
    return {"containers": [{"name": "train", "image": "img", "securityContext": sc}]}


CASES: list[tuple[str, Obj, dict[str, Any], str]] = [
    ("hostNetwork", with_(hostNetwork=True), {"allow_host_network": True},
     f"{WHERE}.hostNetwork is true (allowHostNetwork)"),
    ("hostPID", with_(hostPID=True), {"allow_host_pid": True},
     f"{WHERE}.hostPID is true (allowHostPID)"),
    ("hostIPC", with_(hostIPC=True), {"allow_host_ipc": True},
     f"{WHERE}.hostIPC is true (allowHostIPC)"),
    ("privileged", container_sc(privileged=True), {"allow_privileged": True},
     f"{WHERE}.containers[0].securityContext.privileged is true (allowPrivileged)"),
    ("escalation", container_sc(allowPrivilegeEscalation=True), {"allow_privileged": True},
     f"{WHERE}.containers[0].securityContext.allowPrivilegeEscalation is true"),
    ("capabilities", container_sc(capabilities={"add": ["NET_ADMIN"]}),
     {"allowed_capabilities": ["NET_ADMIN"]},
     f"{WHERE}.containers[0].securityContext.capabilities.add names NET_ADMIN"),
    ("hostPath", with_(volumes=[{"name": "h", "hostPath": {"path": "/var/run/docker.sock"}}]),
     {"allowed_host_paths": ["/var/run"]},
     f"{WHERE}.volumes[0].hostPath.path is '/var/run/docker.sock' (allowedHostPaths)"),
    ("nodeName", with_(nodeName="n1"), {"allow_node_name": True},
     f"{WHERE}.nodeName is set (allowNodeName)"),
    ("serviceAccountName", with_(serviceAccountName="admin"),
     {"allowed_service_accounts": ["admin"]},
     f"{WHERE}.serviceAccountName is 'admin' (allowedServiceAccounts)"),
    ("root", container_sc(runAsUser=0), {"allow_run_as_root": True},
     f"{WHERE}.containers[0].securityContext.runAsUser is 0 (allowRunAsRoot)"),
    ("root init container", {**copy.deepcopy(BASE), "initContainers": [
        {"name": "i", "image": "i", "securityContext": {"runAsNonRoot": False}}]},
     {"allow_run_as_root": True},
     f"{WHERE}.initContainers[0].securityContext.runAsNonRoot is false (allowRunAsRoot)"),
]


@pytest.mark.parametrize(("template", "allow", "message"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_defaults_refuse_and_the_policy_field_allows(template: Obj, allow: dict[str, Any],
                                                     message: str) -> None:
    [found] = violations(template, TemplateLimits(), WHERE)
    assert found.startswith(message)
    assert violations(template, TemplateLimits(**allow), WHERE) == []


def test_host_paths_are_allowed_only_below_an_allowed_prefix() -> None:
    limits = TemplateLimits(allowed_host_paths=["/data"])
    ok = with_(volumes=[{"name": "d", "hostPath": {"path": "/data/set"}}])
    sibling = with_(volumes=[{"name": "d", "hostPath": {"path": "/database"}}])
    assert violations(ok, limits, WHERE) == []
    assert len(violations(sibling, limits, WHERE)) == 1


def test_a_plain_template_and_a_hardened_securitycontext_pass() -> None:
    assert violations(BASE, TemplateLimits(), WHERE) == []
    assert violations(container_sc(**default_security_context()), TemplateLimits(), WHERE) == []


def test_every_role_is_checked() -> None:
    spec = job(mode="ParameterServer", ps={"replicas": 1, "template": {"spec": with_(
        hostNetwork=True)}})["spec"]
    assert job_violations(spec, TemplateLimits()) == [
        "spec.ps.template.spec.hostNetwork is true (allowHostNetwork)"]


def test_containers_without_a_securitycontext_get_the_default_one() -> None:
    body = job()
    body["spec"]["workers"]["template"]["spec"]["containers"].append(
        {"name": "side", "image": "s", "securityContext": {"runAsUser": 1000}})
    spec = harden(body, pod(body, "worker", 0, {}))["spec"]
    train, side = spec["containers"]
    assert train["securityContext"] == {
        "runAsNonRoot": True, "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
    assert side["securityContext"] == {"runAsUser": 1000}
    assert spec["serviceAccountName"] == "tj-runtime"


def test_an_allowed_service_account_is_the_pods() -> None:
    body = job()
    body["spec"]["workers"]["template"]["spec"]["serviceAccountName"] = "trainer"
    assert harden(body, pod(body, "worker", 0, {}))["spec"]["serviceAccountName"] == "trainer"


def test_a_refused_template_creates_no_pod_and_says_which_field() -> None:
    body = job()
    body["spec"]["workers"]["template"]["spec"]["hostNetwork"] = True
    result = run(body)
    assert result.create == []
    cond = next(c for c in result.status["conditions"] if c["type"] == "TemplateAllowed")
    assert cond["status"] == "False" and cond["reason"] == "TemplateRefused"
    assert "spec.workers.template.spec.hostNetwork" in cond["message"]
    assert [e.reason for e in result.events] == ["TemplateRefused"]
    assert "allowHostNetwork" in result.events[0].message
    # Once the template is fixed, the condition turns and pods are created.
    del body["spec"]["workers"]["template"]["spec"]["hostNetwork"]
    body["status"] = result.status
    fixed = run(body)
    assert len(fixed.create) == 4
    cond = next(c for c in fixed.status["conditions"] if c["type"] == "TemplateAllowed")
    assert cond["status"] == "True"


def test_the_policy_model_carries_the_limits() -> None:
    spec = SchedulingPolicySpec.model_validate({"templates": {"allowHostNetwork": True}})
    assert spec.templates.allow_host_network and not spec.templates.allow_privileged
