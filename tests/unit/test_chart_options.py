"""Every chart value, exercised: a table of value sets, each linted with
``helm lint --strict``, rendered with ``helm template`` and the fields it drives
asserted. A last test checks that the table sets every value the schema describes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic.alias_generators import to_camel

from ringwright.devcluster.helm import CHART
from ringwright.devcluster.versions import KUBERNETES
from ringwright.objects import Obj
from ringwright.operator.api.schedulingpolicy import SchedulingPolicy
from ringwright.operator.settings import OperatorSettings
from tests.unit.test_chart_render import (
    FULLNAME,
    RELEASE,
    RELEASE_NS,
    by_kind,
    container,
    helm,
    one,
    render,
    run_helm,
)
from tests.unit.test_chart_values import schema_properties

__all__ = ["helm"]  # the fixture, shared with the chart render tests

DIGEST = "sha256:" + "ab" * 32


def pod_spec(objs: list[Obj]) -> Obj:
    spec: Obj = one(objs, "Deployment")["spec"]["template"]["spec"]
    return spec


def pod_meta(objs: list[Obj]) -> Obj:
    meta: Obj = one(objs, "Deployment")["spec"]["template"]["metadata"]
    return meta


def env(objs: list[Obj]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container(objs)["env"] if "value" in e}


def priority_classes(objs: list[Obj]) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in by_kind(objs, "PriorityClass")}


def policy_spec(objs: list[Obj]) -> Obj:
    policy = one(objs, "SchedulingPolicy")
    SchedulingPolicy.model_validate(policy)  # what the API server will accept
    spec: Obj = policy["spec"]
    return spec


# ------------------------------------------------------------------ checks


def names(objs: list[Obj]) -> None:
    deployment = one(objs, "Deployment")
    assert deployment["metadata"]["name"] == "rw-trainer"
    assert deployment["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == "trainer"


def fullname(objs: list[Obj]) -> None:
    namespaced = [o for o in objs if "namespace" in o["metadata"]]
    assert namespaced
    for obj in namespaced:
        assert obj["metadata"]["name"].startswith("ml-ops"), obj["metadata"]["name"]
    assert one(objs, "ServiceAccount")["metadata"]["name"] == "ml-ops"


def registry_and_tag(objs: list[Obj]) -> None:
    main = container(objs)
    assert main["image"] == "registry.example.com:5000/ml/ringwright-operator:1.2.3"
    assert main["imagePullPolicy"] == "Always"


def digest(objs: list[Obj]) -> None:
    # The digest names the image; a tag beside it would only mislead.
    assert container(objs)["image"] == f"mirror.example/ringwright/operator@{DIGEST}"


def pull_secrets(objs: list[Obj]) -> None:
    assert pod_spec(objs)["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror-cred"}]


def single_replica(objs: list[Obj]) -> None:
    assert one(objs, "Deployment")["spec"]["replicas"] == 1
    assert by_kind(objs, "PodDisruptionBudget") == []


def watch_namespaces(objs: list[Obj]) -> None:
    assert container(objs)["args"][:2] == ["--namespace=team-a", "--namespace=team-b"]
    jobs = [b for b in by_kind(objs, "RoleBinding") if b["roleRef"]["name"] == f"{FULLNAME}-jobs"]
    assert sorted(b["metadata"]["namespace"] for b in jobs) == ["team-a", "team-b"]


def health_port(objs: list[Obj]) -> None:
    main = container(objs)
    assert "--liveness=http://0.0.0.0:9090/healthz" in main["args"]
    assert {"name": "health", "containerPort": 9090, "protocol": "TCP"} in main["ports"]
    assert main["livenessProbe"]["httpGet"]["port"] == "health"


def verbose_and_extras(objs: list[Obj]) -> None:
    main = container(objs)
    assert main["args"][-2:] == ["--verbose", "--lease-seconds=20"]
    assert {"name": "HTTPS_PROXY", "value": "http://127.0.0.1:3128"} in main["env"]


SETTINGS: Obj = {"settleSeconds": 2.5, "drainSeconds": 45, "belowMinGraceSeconds": 600,
                 "psExitGraceSeconds": 15, "rankExitGraceSeconds": 10, "backoffBaseSeconds": 2,
                 "backoffCapSeconds": 120, "resyncSeconds": 20, "roundSpacingSeconds": 0.5,
                 "scaffoldResyncSeconds": 900,
                 "storePort": 29500, "networkPolicy": False, "operatorNamespace": "ops",
                 "kueue": True, "kueueElastic": True, "kueueElasticTopology": True}


def kueue_rules(objs: list[Obj]) -> dict[str, set[str]]:
    """Verbs per kueue.x-k8s.io resource the chart's (Cluster)Roles grant."""
    out: dict[str, set[str]] = {}
    for role in by_kind(objs, "ClusterRole") + by_kind(objs, "Role"):
        for rule in role.get("rules") or ():
            if "kueue.x-k8s.io" in rule["apiGroups"]:
                for resource in rule["resources"]:
                    out.setdefault(resource, set()).update(rule["verbs"])
    return out


def settings(objs: list[Obj]) -> None:
    parsed = OperatorSettings.from_env(env(objs))
    assert {to_camel(k): v for k, v in parsed.model_dump().items()} == SETTINGS
    # The Kueue integration on: the operator may create, watch, resize and withdraw
    # Workloads, mark them Finished, and read ResourceFlavors.
    assert kueue_rules(objs) == {"workloads": {"list", "watch", "create", "patch", "delete"},
                                 "workloads/status": {"patch"},
                                 "resourceflavors": {"list", "watch"},
                                 "workloadpriorityclasses": {"list", "watch"}}


def test_kueue_permissions_only_with_the_integration_on(helm: Path, tmp_path: Path) -> None:
    assert kueue_rules(render(helm, tmp_path, {})) == {}


def resources(objs: list[Obj]) -> None:
    assert container(objs)["resources"] == {"requests": {"cpu": "250m", "memory": "512Mi"},
                                            "limits": {"memory": "2Gi"}}


def pod_placement(objs: list[Obj]) -> None:
    spec, meta = pod_spec(objs), pod_meta(objs)
    assert spec["priorityClassName"] == "system-cluster-critical"
    assert spec["nodeSelector"] == {"node-role.kubernetes.io/control-plane": ""}
    assert spec["tolerations"] == [{"key": "node-role.kubernetes.io/control-plane",
                                     "operator": "Exists", "effect": "NoSchedule"}]
    assert spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert meta["annotations"] == {"example.com/owner": "ml-platform"}
    assert meta["labels"]["team"] == "ml-platform"
    # Extra pod labels never reach the selector, which cannot change after install.
    assert "team" not in one(objs, "Deployment")["spec"]["selector"]["matchLabels"]


def pod_security_overrides(objs: list[Obj]) -> None:
    # Your keys are merged into the defaults: those you leave out stay.
    assert pod_spec(objs)["securityContext"] == {
        "runAsNonRoot": False, "runAsUser": 20000, "runAsGroup": 20000, "fsGroup": 20000,
        "seccompProfile": {"type": "Localhost", "localhostProfile": "operator.json"}}


def pod_security_dropped_ids(objs: list[Obj]) -> None:
    # null drops a default: the platform (OpenShift's restricted SCC) picks the ids.
    assert pod_spec(objs)["securityContext"] == {"runAsNonRoot": True,
                                                 "seccompProfile": {"type": "RuntimeDefault"}}


def container_security(objs: list[Obj]) -> None:
    assert container(objs)["securityContext"] == {
        "runAsNonRoot": False, "allowPrivilegeEscalation": True,
        "readOnlyRootFilesystem": False, "capabilities": {"drop": ["NET_RAW"]}}


def metrics_off(objs: list[Obj]) -> None:
    assert by_kind(objs, "Service") == []
    assert [p["name"] for p in container(objs)["ports"]] == ["health"]


def metrics_without_service(objs: list[Obj]) -> None:
    assert by_kind(objs, "Service") == []
    assert by_kind(objs, "ServiceMonitor") == []  # it would select no Service
    assert "--metrics-port=9500" in container(objs)["args"]


def monitors_and_dashboard(objs: list[Obj]) -> None:
    service_monitor = one(objs, "ServiceMonitor")
    assert service_monitor["metadata"]["labels"]["release"] == "kps"
    assert service_monitor["spec"]["endpoints"][0]["interval"] == "1m"
    pod_monitor = one(objs, "PodMonitor")
    assert pod_monitor["metadata"]["labels"]["release"] == "kps"
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["interval"] == "10s"
    dashboard = one(objs, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "ml"
    assert json.loads(dashboard["data"]["ringwright.json"])["panels"]


def existing_service_account(objs: list[Obj]) -> None:
    assert by_kind(objs, "ServiceAccount") == []
    assert pod_spec(objs)["serviceAccountName"] == "ringwright-operator"
    for binding in by_kind(objs, "ClusterRoleBinding") + by_kind(objs, "RoleBinding"):
        assert binding["subjects"][0]["name"] == "ringwright-operator"


def service_account_annotations(objs: list[Obj]) -> None:
    sa = one(objs, "ServiceAccount")
    assert sa["metadata"]["annotations"] == {"example.com/role": "operator"}
    assert pod_spec(objs)["serviceAccountName"] == "ops-sa"


def no_rbac(objs: list[Obj]) -> None:
    for kind in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"):
        assert by_kind(objs, kind) == []


def reused_classes(objs: list[Obj]) -> None:
    assert by_kind(objs, "PriorityClass") == []
    # The policy still names them: they exist in the cluster already.
    assert policy_spec(objs)["priorityClasses"] == {"ps": "team-ps", "worker": "team-worker"}


def default_preemption(objs: list[Obj]) -> None:
    classes = priority_classes(objs)
    # Workers never evict other workloads; ps pods evict only pods below them,
    # where the planner places them when nothing is free near the workers.
    assert classes["ringwright-worker"]["preemptionPolicy"] == "Never"
    assert classes["ringwright-ps"]["preemptionPolicy"] == "PreemptLowerPriority"
    assert classes["ringwright-ps"]["value"] > classes["ringwright-worker"]["value"]
    for pc in classes.values():
        assert pc["globalDefault"] is False


def custom_classes(objs: list[Obj]) -> None:
    classes = priority_classes(objs)
    assert sorted(classes) == ["team-ps", "team-worker"]
    assert (classes["team-ps"]["value"], classes["team-worker"]["value"]) == (50000, 40000)
    assert classes["team-ps"]["preemptionPolicy"] == "Never"
    assert classes["team-worker"]["preemptionPolicy"] == "PreemptLowerPriority"
    assert classes["team-ps"]["description"] == "Team ps."
    assert classes["team-worker"]["description"] == "Team workers."
    assert policy_spec(objs)["priorityClasses"] == {"ps": "team-ps", "worker": "team-worker"}


def no_policy(objs: list[Obj]) -> None:
    assert by_kind(objs, "SchedulingPolicy") == []


def policy_fields(objs: list[Obj]) -> None:
    assert one(objs, "SchedulingPolicy")["metadata"]["name"] == "gpu-pool"
    assert policy_spec(objs) == {
        "nodeLabels": {"rack": "topology.example.com/rack",
                       "nvlinkDomain": "topology.example.com/nvlink",
                       "gpuModel": "topology.example.com/gpu",
                       "spine": "topology.example.com/spine"},
        "gpuResource": "amd.com/gpu",
        "priorityClasses": {"ps": "ringwright-ps", "worker": "ringwright-worker"},
        "psPinning": {"enabled": False, "defaultCpus": 8, "defaultMemory": "16Gi"},
        "allowedGpuModels": ["MI300X"],
        "rackPacking": "Preferred",
        "gangTimeoutSeconds": 600,
        "nodeLoss": {"tolerationSeconds": 120, "unreadySeconds": 180},
        "stragglers": STRAGGLERS,
        "limits": {"maxWorkersPerJob": 256, "maxPsPerJob": 16, "maxRacksPerJob": 4},
        "templates": TEMPLATES,
    }


STRAGGLERS: Obj = {"enabled": False, "factor": 2.5, "windowSeconds": 600, "avoidSeconds": 60}
TEMPLATES: Obj = {"allowHostNetwork": True, "allowHostPID": True, "allowHostIPC": True,
                  "allowPrivileged": True, "allowRunAsRoot": True,
                  "allowedCapabilities": ["NET_ADMIN", "IPC_LOCK"],
                  "allowedHostPaths": ["/dev/infiniband"], "allowNodeName": True,
                  "allowedServiceAccounts": ["trainer"]}


def global_ignored(objs: list[Obj]) -> None:
    assert container(objs)["image"] == "ringwright/operator:0.1.0"


@dataclass(frozen=True)
class Case:
    id: str
    values: Obj
    check: Callable[[list[Obj]], None]


CASES: list[Case] = [
    Case("name-override", {"nameOverride": "trainer"}, names),
    Case("fullname-override", {"fullnameOverride": "ml-ops"}, fullname),
    Case("registry-and-tag", {"image": {
        "registry": "registry.example.com:5000", "repository": "ml/ringwright-operator",
        "tag": "1.2.3", "pullPolicy": "Always"}}, registry_and_tag),
    Case("digest", {"image": {"registry": "mirror.example", "tag": "1.2.3", "digest": DIGEST}},
         digest),
    Case("pull-secrets", {"imagePullSecrets": ["regcred", {"name": "mirror-cred"}]},
         pull_secrets),
    Case("single-replica", {"operator": {"replicas": 1}}, single_replica),
    Case("watch-namespaces", {"operator": {"watchNamespaces": ["team-a", "team-b"]}},
         watch_namespaces),
    Case("health-port", {"operator": {"healthPort": 9090}}, health_port),
    Case("verbose-and-extras", {"operator": {
        "verbose": True, "extraArgs": ["--lease-seconds=20"],
        "extraEnv": [{"name": "HTTPS_PROXY", "value": "http://127.0.0.1:3128"}]}},
        verbose_and_extras),
    Case("settings", {"operator": {"settings": SETTINGS}}, settings),
    # null drops a default: no CPU limit.
    Case("resources", {"operator": {"resources": {
        "requests": {"cpu": "250m", "memory": "512Mi"},
        "limits": {"cpu": None, "memory": "2Gi"}}}}, resources),
    Case("pod-placement", {"operator": {
        "priorityClassName": "system-cluster-critical",
        "podAnnotations": {"example.com/owner": "ml-platform"},
        "podLabels": {"team": "ml-platform"},
        "nodeSelector": {"node-role.kubernetes.io/control-plane": ""},
        "tolerations": [{"key": "node-role.kubernetes.io/control-plane",
                         "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"topologyKey": "kubernetes.io/hostname",
             "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "operator"}}}]}},
    }}, pod_placement),
    Case("pod-security-overrides", {"operator": {"podSecurityContext": {
        "runAsNonRoot": False, "runAsUser": 20000, "runAsGroup": 20000, "fsGroup": 20000,
        "seccompProfile": {"type": "Localhost", "localhostProfile": "operator.json"}}}},
        pod_security_overrides),
    Case("pod-security-dropped-ids", {"operator": {"podSecurityContext": {
        "runAsUser": None, "runAsGroup": None}}}, pod_security_dropped_ids),
    Case("container-security", {"operator": {"securityContext": {
        "runAsNonRoot": False, "allowPrivilegeEscalation": True,
        "readOnlyRootFilesystem": False, "capabilities": {"drop": ["NET_RAW"]}}}},
        container_security),
    Case("metrics-off", {"metrics": {"port": 0}}, metrics_off),
    Case("metrics-without-service", {"metrics": {"port": 9500, "service": {"enabled": False},
                                                 "serviceMonitor": {"enabled": True}}},
         metrics_without_service),
    Case("monitors-and-dashboard", {"metrics": {
        "serviceMonitor": {"enabled": True, "interval": "1m", "labels": {"release": "kps"}},
        "podMonitor": {"enabled": True, "interval": "10s", "labels": {"release": "kps"}},
        "dashboard": {"enabled": True, "labels": {"grafana_dashboard": "ml"}}}},
        monitors_and_dashboard),
    Case("existing-service-account", {"serviceAccount": {"create": False,
                                                         "name": "ringwright-operator"}},
         existing_service_account),
    Case("service-account-annotations", {"serviceAccount": {
        "name": "ops-sa", "annotations": {"example.com/role": "operator"}}},
        service_account_annotations),
    Case("no-rbac", {"rbac": {"create": False}}, no_rbac),
    Case("reused-classes", {"priorityClasses": {"create": False, "ps": {"name": "team-ps"},
                                                "worker": {"name": "team-worker"}}},
         reused_classes),
    Case("default-preemption", {}, default_preemption),
    Case("custom-classes", {"priorityClasses": {
        "ps": {"name": "team-ps", "value": 50000, "preemptionPolicy": "Never",
               "description": "Team ps."},
        "worker": {"name": "team-worker", "value": 40000,
                   "preemptionPolicy": "PreemptLowerPriority",
                   "description": "Team workers."}}}, custom_classes),
    Case("no-policy", {"schedulingPolicy": {"create": False}}, no_policy),
    Case("policy-fields", {"schedulingPolicy": {
        "name": "gpu-pool",
        "nodeLabels": {"rack": "topology.example.com/rack",
                       "nvlinkDomain": "topology.example.com/nvlink",
                       "gpuModel": "topology.example.com/gpu",
                       "spine": "topology.example.com/spine"},
        "gpuResource": "amd.com/gpu",
        "psPinning": {"enabled": False, "defaultCpus": 8, "defaultMemory": "16Gi"},
        "allowedGpuModels": ["MI300X"],
        "rackPacking": "Preferred",
        "gangTimeoutSeconds": 600,
        "nodeLoss": {"tolerationSeconds": 120, "unreadySeconds": 180},
        "stragglers": STRAGGLERS,
        "limits": {"maxWorkersPerJob": 256, "maxPsPerJob": 16, "maxRacksPerJob": 4},
        "templates": TEMPLATES}}, policy_fields),
    Case("global", {"global": {"imageRegistry": "ignored.example"}}, global_ignored),
]


def _write(values: Obj, tmp: Path) -> Path:
    path = tmp / "case-values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_value_set_lints_renders_and_drives_its_fields(
    helm: Path, tmp_path: Path, case: Case
) -> None:
    proc = run_helm(helm, "lint", "--strict", str(CHART), "--namespace", RELEASE_NS,
                    "--kube-version", KUBERNETES, "--values", str(_write(case.values, tmp_path)))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "[WARNING]" not in out and "[ERROR]" not in out, out
    objs = render(helm, tmp_path, case.values)
    for obj in objs:
        if "namespace" in obj["metadata"] and obj["kind"] not in ("Role", "RoleBinding"):
            assert obj["metadata"]["namespace"] == RELEASE_NS, obj["metadata"]
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    case.check(objs)


def _set_paths(values: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    if isinstance(values, dict):
        for key, sub in values.items():
            yield (*path, key)
            yield from _set_paths(sub, (*path, key))


def test_the_table_sets_every_value() -> None:
    """A value added to the chart needs a case here (and its check)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    described = {path for path, _ in schema_properties(schema, schema)}
    exercised = {p for case in CASES for p in _set_paths(case.values)}
    missing = sorted(".".join(p) for p in described - exercised)
    assert not missing, f"no case sets {missing}"
