"""Packaging, checked without a cluster: the Helm chart as rendered by the real
``helm`` binary, its CRDs against the generated ones, and the Dockerfile parsed.

The chart tests need the pinned helm that ``python -m ringwright.devcluster build``
puts in the cache; without it they skip, except in CI where they fail.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from pydantic.alias_generators import to_camel

from ringwright.devcluster.helm import CHART, find_helm
from ringwright.devcluster.versions import KUBERNETES
from ringwright.objects import Obj
from ringwright.operator.__main__ import main as operator_main
from ringwright.operator.api.schedulingpolicy import (
    DEFAULT_POLICY_NAME,
    SchedulingPolicy,
    SchedulingPolicySpec,
)
from ringwright.operator.settings import OperatorSettings

REPO = Path(__file__).resolve().parents[2]
REPO_CRDS = REPO / "crds"
CHART_CRDS = CHART / "crds"
CRD_FILES = ("schedulingpolicies.ringwright.dev.yaml", "trainingjobs.ringwright.dev.yaml")
IN_CI = os.environ.get("CI", "").lower() == "true"
RELEASE = "rw"
RELEASE_NS = "ringwright-system"
FULLNAME = "rw-ringwright"


# ------------------------------------------------------------------ helm


@pytest.fixture(scope="module")
def helm() -> Path:
    path = find_helm()
    if path is None:
        message = ("no helm binary: run `python -m ringwright.devcluster build` (it builds the "
                   "pinned helm into the cache) or put helm on PATH")
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return path


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # A private HOME-like config: no user repositories or plugins leak into the test.
    env = {**os.environ, "HELM_CONFIG_HOME": "/nonexistent-helm-config",
           "HELM_CACHE_HOME": "/nonexistent-helm-cache"}
    return subprocess.run([str(helm), *args], capture_output=True, text=True, env=env,
                          timeout=120, check=False)


def _template_args(values: Obj | None, tmp: Path, *extra: str) -> list[str]:
    # --kube-version: without a cluster helm assumes the Kubernetes version it was
    # built for, which the chart's kubeVersion may refuse; render for the pinned one.
    args = ["template", RELEASE, str(CHART), "--namespace", RELEASE_NS,
            "--kube-version", KUBERNETES, *extra]
    if values is not None:
        path = tmp / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        args += ["--values", str(path)]
    return args


def render(helm: Path, tmp: Path, values: Obj | None = None, *extra: str) -> list[Obj]:
    """Every object ``helm template`` renders, in order."""
    proc = run_helm(helm, *_template_args(values, tmp, *extra))
    assert proc.returncode == 0, f"helm template failed:\n{proc.stderr}"
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def render_error(helm: Path, tmp: Path, values: Obj) -> str:
    """The error helm prints for values it must refuse."""
    proc = run_helm(helm, *_template_args(values, tmp))
    assert proc.returncode != 0, f"helm accepted {values}:\n{proc.stdout[:2000]}"
    return proc.stderr


def by_kind(objs: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = [o for o in by_kind(objs, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


def container(objs: list[Obj]) -> Obj:
    containers = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    result: Obj = containers[0]
    return result


@pytest.fixture()
def defaults(helm: Path, tmp_path: Path) -> list[Obj]:
    return render(helm, tmp_path)


# ------------------------------------------------------------------ CRDs


def test_chart_crds_are_the_generated_crds() -> None:
    """One source of truth: the chart ships exactly the files in the repository's crds/."""
    assert CHART_CRDS.is_dir(), f"{CHART_CRDS} is missing"
    repo = {p.name: p.read_bytes() for p in sorted(REPO_CRDS.glob("*.yaml"))}
    chart = {p.name: p.read_bytes() for p in sorted(CHART_CRDS.iterdir()) if p.is_file()}
    for name in CRD_FILES:
        assert name in repo, f"crds/{name} is missing: regenerate the CRDs"
    assert sorted(chart) == sorted(repo), "the chart's crds/ and the repository's crds/ differ"
    stale = [name for name in repo if chart[name] != repo[name]]
    assert not stale, f"charts/ringwright/crds/ is stale for {stale}: copy crds/ over it"


def _crd_spec_schema(plural: str) -> Obj:
    crd = yaml.safe_load((CHART_CRDS / f"{plural}.ringwright.dev.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
    spec: Obj = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec


def test_helm_installs_the_crds_the_repository_generates(helm: Path, tmp_path: Path) -> None:
    objs = render(helm, tmp_path, None, "--include-crds")
    crds = {o["metadata"]["name"]: o for o in by_kind(objs, "CustomResourceDefinition")}
    assert sorted(crds) == ["schedulingpolicies.ringwright.dev", "trainingjobs.ringwright.dev"]
    assert crds["trainingjobs.ringwright.dev"]["spec"]["scope"] == "Namespaced"
    assert crds["schedulingpolicies.ringwright.dev"]["spec"]["scope"] == "Cluster"


# ------------------------------------------------------------------ lint


@pytest.mark.parametrize("values", [None, {"operator": {"watchNamespaces": ["team-a", "team-b"]}}],
                         ids=["all-namespaces", "namespace-list"])
def test_helm_lint_is_clean(helm: Path, tmp_path: Path, values: Obj | None) -> None:
    args = ["lint", "--strict", str(CHART), "--namespace", RELEASE_NS,
            "--kube-version", KUBERNETES]
    if values is not None:
        (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
        args += ["--values", str(tmp_path / "values.yaml")]
    proc = run_helm(helm, *args)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "[WARNING]" not in out and "[ERROR]" not in out, out


# ------------------------------------------------------------------ RBAC

# Every permission the operator holds, as (ClusterRole suffix, group, resource, verb).
# A change here is a change to the operator's privileges: make it on purpose.
_WATCH = ("list", "watch")
_CLUSTER_READS = {
    ("ringwright.dev", "schedulingpolicies", v) for v in _WATCH
} | {
    ("", "nodes", v) for v in _WATCH
} | {
    ("apiextensions.k8s.io", "customresourcedefinitions", v) for v in _WATCH
} | {
    ("scheduling.k8s.io", "priorityclasses", v) for v in _WATCH
}
_POD_READS = {("", "pods", v) for v in _WATCH}
_CLUSTER = _CLUSTER_READS | _POD_READS
"""Serving every namespace: node capacity counts every pod."""
_APPLY = ("create", "patch")
_JOBS = (
    {("ringwright.dev", "trainingjobs", v) for v in ("list", "watch", "patch", "delete")}
    | {("ringwright.dev", "trainingjobs/status", "patch")}
    | {("", "pods", v) for v in ("create", "delete", "patch")}
    | {("", "configmaps", v) for v in ("get", "list", "watch", "create", "patch")}
    | {("", r, v) for r in ("services", "serviceaccounts") for v in _WATCH + _APPLY}
    | {("rbac.authorization.k8s.io", r, v) for r in ("roles", "rolebindings")
       for v in _WATCH + _APPLY}
    | {("networking.k8s.io", "networkpolicies", v) for v in _WATCH + _APPLY}
    | {("", "secrets", "create")}
    | {("", "events", v) for v in ("create", "patch")}
)
_NAMESPACES = {("", "namespaces", v) for v in ("list", "watch")}
_LEADER = {("coordination.k8s.io", "leases", v) for v in ("get", "create", "update")}


def permissions(role: Obj) -> set[tuple[str, str, str]]:
    perms: set[tuple[str, str, str]] = set()
    for rule in role["rules"]:
        assert not rule.get("resourceNames"), "the operator's own rules never narrow by name"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    perms.add((group, resource, verb))
    return perms


def test_rbac_grants_exactly_what_the_operator_needs(defaults: list[Obj]) -> None:
    roles = {o["metadata"]["name"]: o for o in by_kind(defaults, "ClusterRole")}
    assert sorted(roles) == [f"{FULLNAME}-cluster", f"{FULLNAME}-jobs"]
    assert permissions(roles[f"{FULLNAME}-cluster"]) == _CLUSTER
    assert permissions(roles[f"{FULLNAME}-jobs"]) == _JOBS
    # The one namespaced Role: the leader-election Lease, in the release namespace only.
    [leader] = by_kind(defaults, "Role")
    assert leader["metadata"] == {**leader["metadata"], "name": f"{FULLNAME}-leader",
                                  "namespace": RELEASE_NS}
    assert permissions(leader) == _LEADER


@pytest.mark.parametrize("values", [None, {"operator": {"watchNamespaces": ["a", "b"]}}],
                         ids=["all-namespaces", "namespace-list"])
def test_rbac_never_reaches_secrets_wildcards_or_escalation(
    helm: Path, tmp_path: Path, values: Obj | None
) -> None:
    objs = render(helm, tmp_path, values)
    for role in by_kind(objs, "ClusterRole") + by_kind(objs, "Role"):
        for group, resource, verb in permissions(role):
            # Creating the jobs' join tokens only: never reading a Secret back.
            assert "secrets" not in resource or verb == "create", \
                f"{role['metadata']['name']} grants {verb} {resource}"
            assert "*" not in (group, resource, verb), f"wildcard in {role['metadata']['name']}"
            assert verb not in ("bind", "escalate", "impersonate"), (
                f"{role['metadata']['name']} grants {verb}")


def test_operator_can_grant_what_per_job_roles_need(defaults: list[Obj]) -> None:
    """RBAC lets the operator create a Role only with verbs it holds itself."""
    jobs = permissions(one(defaults, "ClusterRole", f"{FULLNAME}-jobs"))
    for verb in ("get", "list", "watch", "patch"):  # world: read; reports: patch
        assert ("", "configmaps", verb) in jobs


def test_all_namespaces_binds_both_roles_cluster_wide_to_the_service_account(
    defaults: list[Obj],
) -> None:
    sa = one(defaults, "ServiceAccount")["metadata"]
    assert sa["namespace"] == RELEASE_NS
    bindings = {b["roleRef"]["name"]: b for b in by_kind(defaults, "ClusterRoleBinding")}
    assert sorted(bindings) == [f"{FULLNAME}-cluster", f"{FULLNAME}-jobs"]
    for binding in bindings.values():
        assert binding["roleRef"]["kind"] == "ClusterRole"
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": sa["name"], "namespace": RELEASE_NS}]
    [leader] = by_kind(defaults, "RoleBinding")
    assert leader["roleRef"]["name"] == f"{FULLNAME}-leader"
    assert leader["metadata"]["namespace"] == RELEASE_NS
    assert permissions(one(defaults, "ClusterRole", f"{FULLNAME}-cluster")).isdisjoint(_NAMESPACES)


def test_namespace_list_grants_job_rights_only_in_those_namespaces(
    helm: Path, tmp_path: Path
) -> None:
    objs = render(helm, tmp_path, {"operator": {"watchNamespaces": ["team-a", "team-b"]}})
    cluster_bindings = by_kind(objs, "ClusterRoleBinding")
    assert [b["roleRef"]["name"] for b in cluster_bindings] == [f"{FULLNAME}-cluster"]
    role_bindings = [b for b in by_kind(objs, "RoleBinding")
                     if b["roleRef"]["name"] != f"{FULLNAME}-leader"]
    assert sorted(b["metadata"]["namespace"] for b in role_bindings) == ["team-a", "team-b"]
    for binding in role_bindings:
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                      "kind": "Role", "name": f"{FULLNAME}-jobs"}
        assert binding["subjects"][0]["namespace"] == RELEASE_NS
    # No ClusterRole for the jobs' objects: a Role in each watched namespace.
    assert sorted(r["metadata"]["name"] for r in by_kind(objs, "ClusterRole")) == [
        f"{FULLNAME}-cluster"]
    roles = [r for r in by_kind(objs, "Role") if r["metadata"]["name"] == f"{FULLNAME}-jobs"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        assert permissions(role) == _JOBS | _POD_READS
    # kopf follows the watched namespaces being created and deleted; no pod is read
    # outside them.
    assert permissions(one(objs, "ClusterRole", f"{FULLNAME}-cluster")) == (
        _CLUSTER_READS | _NAMESPACES)
    assert container(objs)["args"][:2] == ["--namespace=team-a", "--namespace=team-b"]


# ------------------------------------------------------------------ Deployment


def test_deployment_runs_two_replicas_electing_a_leader_with_a_disruption_budget(
        defaults: list[Obj]) -> None:
    deployment = one(defaults, "Deployment", FULLNAME)
    assert deployment["metadata"]["namespace"] == RELEASE_NS
    assert deployment["spec"]["replicas"] == 2
    assert "strategy" not in deployment["spec"]  # a rolling update: the Lease hands over
    pdb = one(defaults, "PodDisruptionBudget", FULLNAME)
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]
    env = {e["name"]: e for e in container(defaults)["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    pod = deployment["spec"]["template"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["serviceAccountName"] == one(defaults, "ServiceAccount")["metadata"]["name"]
    main = container(defaults)
    assert main["command"] == ["python", "-m", "ringwright.operator"]
    assert main["image"] == "ringwright/operator:0.1.0"
    # No --namespace: the operator serves every namespace.
    assert main["args"] == ["--liveness=http://0.0.0.0:8080/healthz", "--metrics-port=9400"]


def test_chart_passes_only_flags_and_settings_the_operator_accepts(
    helm: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = {"settleSeconds": 0.5, "storePort": 29500, "belowMinGraceSeconds": 300}
    objs = render(helm, tmp_path, {"operator": {"watchNamespaces": ["a"], "verbose": True,
                                                "settings": settings}})
    main = container(objs)
    with pytest.raises(SystemExit) as exited:
        operator_main(["--help"])
    assert exited.value.code == 0
    usage = capsys.readouterr().out
    for arg in main["args"]:
        flag = arg.split("=", 1)[0]
        assert re.search(rf"(^|\s){re.escape(flag)}\b", usage), f"the operator has no {flag}"
    env = {e["name"]: e["value"] for e in main["env"] if "value" in e}
    parsed = OperatorSettings.from_env(env)
    assert (parsed.settle_seconds, parsed.store_port, parsed.below_min_grace_seconds) == (
        0.5, 29500, 300.0)
    schema = json.loads((CHART / "values.schema.json").read_text())
    documented = schema["properties"]["operator"]["properties"]["settings"]["properties"]
    assert set(documented) == {to_camel(name) for name in OperatorSettings.model_fields}


def test_deployment_is_non_root_with_a_read_only_root_filesystem(defaults: list[Obj]) -> None:
    pod = one(defaults, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container(defaults)["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    # The one writable place is a bounded emptyDir.
    mounts = {m["name"]: m["mountPath"] for m in container(defaults)["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts == {"tmp": "/tmp"} and "emptyDir" in volumes["tmp"]


def test_deployment_probes_kopf_health_endpoint_and_sets_resources(defaults: list[Obj]) -> None:
    main = container(defaults)
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert ports == {"health": 8080, "metrics": 9400}
    for probe in ("livenessProbe", "startupProbe"):
        assert main[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    for kind in ("requests", "limits"):
        assert set(main["resources"][kind]) == {"cpu", "memory"}


def test_values_configure_image_resources_port_and_pod_placement(
    helm: Path, tmp_path: Path
) -> None:
    objs = render(helm, tmp_path, {
        "image": {"repository": "registry.example/ops/ringwright", "tag": "1.2.3",
                  "pullPolicy": "Always"},
        "imagePullSecrets": ["pull"],
        "operator": {"healthPort": 9090, "extraArgs": ["--verbose"],
                     # null drops a default: no CPU limit.
                     "resources": {"requests": {"cpu": "250m", "memory": "512Mi"},
                                   "limits": {"cpu": None, "memory": "2Gi"}},
                     "extraEnv": [{"name": "EXTRA", "value": "1"}],
                     "nodeSelector": {"pool": "system"}},
    })
    deployment = one(objs, "Deployment")["spec"]["template"]["spec"]
    main = container(objs)
    assert main["image"] == "registry.example/ops/ringwright:1.2.3"
    assert main["imagePullPolicy"] == "Always"
    assert deployment["imagePullSecrets"] == [{"name": "pull"}]
    assert deployment["nodeSelector"] == {"pool": "system"}
    assert "--liveness=http://0.0.0.0:9090/healthz" in main["args"]
    assert main["args"][-1] == "--verbose"
    assert main["ports"] == [{"name": "health", "containerPort": 9090, "protocol": "TCP"},
                             {"name": "metrics", "containerPort": 9400, "protocol": "TCP"}]
    assert main["resources"] == {"requests": {"cpu": "250m", "memory": "512Mi"},
                                 "limits": {"memory": "2Gi"}}
    assert {"name": "EXTRA", "value": "1"} in main["env"]


def test_create_switches_leave_out_their_objects(helm: Path, tmp_path: Path) -> None:
    objs = render(helm, tmp_path, {
        "serviceAccount": {"create": False, "name": "existing"},
        "rbac": {"create": False},
        "priorityClasses": {"create": False},
        "schedulingPolicy": {"create": False},
        "metrics": {"port": 9400, "service": {"enabled": False}},
    })
    assert sorted(o["kind"] for o in objs) == ["Deployment", "PodDisruptionBudget"]
    assert one(objs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "existing"


# ------------------------------------------------------------------ priority and policy


def test_ps_priority_class_outranks_the_worker_class(defaults: list[Obj]) -> None:
    classes = {o["metadata"]["name"]: o for o in by_kind(defaults, "PriorityClass")}
    assert sorted(classes) == ["ringwright-ps", "ringwright-worker"]
    assert classes["ringwright-ps"]["value"] > classes["ringwright-worker"]["value"]
    for pc in classes.values():
        assert pc["globalDefault"] is False


def test_default_policy_is_the_api_default_and_names_the_chart_classes(
    defaults: list[Obj],
) -> None:
    policy = one(defaults, "SchedulingPolicy", DEFAULT_POLICY_NAME)
    assert policy["apiVersion"] == "ringwright.dev/v1alpha1"
    assert "namespace" not in policy["metadata"], "SchedulingPolicy is cluster-scoped"
    SchedulingPolicy.model_validate(policy)
    # The chart's defaults are the API's defaults: a job sees the same policy whether
    # the chart or the API server filled it in.
    assert policy["spec"] == SchedulingPolicySpec().to_wire()
    classes = {o["metadata"]["name"] for o in by_kind(defaults, "PriorityClass")}
    assert set(policy["spec"]["priorityClasses"].values()) == classes


def test_policy_fields_come_from_values(helm: Path, tmp_path: Path) -> None:
    objs = render(helm, tmp_path, {
        "priorityClasses": {"ps": {"name": "gold"}, "worker": {"name": "silver"}},
        "schedulingPolicy": {
            "allowedGpuModels": ["NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-80GB"],
            "rackPacking": "Preferred",
            "nodeLabels": {"spine": "example.com/spine"},
            "limits": {"maxRacksPerJob": 4},
            "psPinning": {"enabled": False},
        },
    })
    spec = SchedulingPolicy.model_validate(one(objs, "SchedulingPolicy")).spec
    assert spec.allowed_gpu_models == ["NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-80GB"]
    assert spec.rack_packing == "Preferred"
    assert spec.node_labels.spine == "example.com/spine"
    assert spec.limits.max_racks_per_job == 4
    assert spec.limits.max_workers_per_job == 1024
    assert spec.ps_pinning.enabled is False
    assert (spec.priority_classes.ps, spec.priority_classes.worker) == ("gold", "silver")
    assert sorted(o["metadata"]["name"] for o in by_kind(objs, "PriorityClass")) == [
        "gold", "silver"]


def _resolve(schema: Obj, root: Obj) -> Obj:
    """Follow local $ref and merge allOf, enough for values.schema.json."""
    if "$ref" in schema:
        name = schema["$ref"].removeprefix("#/definitions/")
        schema = {**root["definitions"][name], **{k: v for k, v in schema.items() if k != "$ref"}}
    merged = {k: v for k, v in schema.items() if k != "allOf"}
    for part in schema.get("allOf", []):
        merged = {**_resolve(part, root), **merged}
    return merged


def _leaves(schema: Obj, root: Obj, path: tuple[str, ...] = ()) -> Iterator[
        tuple[tuple[str, ...], Obj]]:
    schema = _resolve(schema, root)
    if "properties" in schema:
        for key, sub in schema["properties"].items():
            yield from _leaves(sub, root, (*path, key))
    else:
        yield path, schema


def test_values_schema_bounds_agree_with_the_crd() -> None:
    """values.schema.json refuses at `helm install` what the API server would refuse later."""
    root = json.loads((CHART / "values.schema.json").read_text())
    policy = root["properties"]["schedulingPolicy"]["properties"]
    crd = _crd_spec_schema("schedulingpolicies")
    compared = 0
    for key, sub in policy.items():
        if key in ("create", "name"):
            continue
        for path, leaf in _leaves(sub, root, (key,)):
            target = crd
            for part in path:
                assert part in target.get("properties", {}), (
                    f"schedulingPolicy.{'.'.join(path)} is not a SchedulingPolicy spec field")
                target = target["properties"][part]
            if target.get("type") == "array":
                leaf, target = _resolve(leaf.get("items", {}), root), target.get("items", {})
            for bound in ("minimum", "maximum", "minLength", "maxLength", "pattern", "enum"):
                if bound in target:
                    assert leaf.get(bound) == target[bound], (
                        f"schedulingPolicy.{'.'.join(path)}: {bound} is {leaf.get(bound)!r} "
                        f"in values.schema.json but {target[bound]!r} in the CRD")
                    compared += 1
    assert compared >= 10


# ------------------------------------------------------------------ bad values

_BAD_VALUES: list[tuple[str, Obj, str]] = [
    ("replicas-not-a-value", {"replicaCount": 2}, "replicaCount"),
    ("no-operator-replica", {"operator": {"replicas": 0}}, "/operator/replicas"),
    ("ps-below-worker", {"priorityClasses": {"ps": {"value": 10}, "worker": {"value": 20}}},
     "priorityClasses.ps.value"),
    ("ps-equals-worker", {"priorityClasses": {"ps": {"value": 20}, "worker": {"value": 20}}},
     "priorityClasses.ps.value"),
    ("same-class-name", {"priorityClasses": {"ps": {"name": "x"}, "worker": {"name": "x"}}},
     "must differ"),
    ("reserved-class-name", {"priorityClasses": {"ps": {"name": "system-ps"}}}, "name"),
    ("class-value-too-high", {"priorityClasses": {"ps": {"value": 2000000000}}}, "value"),
    ("bad-namespace", {"operator": {"watchNamespaces": ["Team_A"]}}, "watchNamespaces"),
    ("duplicate-namespace", {"operator": {"watchNamespaces": ["a", "a"]}}, "watchNamespaces"),
    ("bad-pull-policy", {"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
    ("root-user", {"operator": {"podSecurityContext": {"runAsUser": 0}}}, "runAsUser"),
    ("bad-seccomp-type", {"operator": {"podSecurityContext": {"seccompProfile": {
        "type": "runtime/default"}}}}, "type"),
    ("tag-in-repository", {"image": {"repository": "ringwright/operator:1.0"}}, "repository"),
    ("tag-with-colon", {"image": {"tag": "1.0:latest"}}, "tag"),
    ("short-digest", {"image": {"digest": "sha256:abc"}}, "digest"),
    ("registry-with-slash", {"image": {"registry": "ghcr.io/"}}, "registry"),
    ("pull-secret-without-name", {"imagePullSecrets": [{"secret": "regcred"}]},
     "imagePullSecrets"),
    ("bad-preemption-policy", {"priorityClasses": {"worker": {"preemptionPolicy": "Always"}}},
     "preemptionPolicy"),
    ("unknown-setting", {"operator": {"settings": {"settleSecs": 1}}}, "settleSecs"),
    ("negative-setting", {"operator": {"settings": {"drainSeconds": -1}}}, "drainSeconds"),
    ("privileged-port", {"operator": {"healthPort": 80}}, "healthPort"),
    ("bad-memory", {"operator": {"resources": {"limits": {"memory": "lots"}}}}, "memory"),
    ("typo-in-resources", {"operator": {"resources": {"limit": {}}}}, "limit"),
    ("bad-rack-packing", {"schedulingPolicy": {"rackPacking": "Maybe"}}, "rackPacking"),
    ("zero-workers", {"schedulingPolicy": {"limits": {"maxWorkersPerJob": 0}}},
     "maxWorkersPerJob"),
    ("bad-ps-memory", {"schedulingPolicy": {"psPinning": {"defaultMemory": "8 GB"}}},
     "defaultMemory"),
    ("bad-label-key", {"schedulingPolicy": {"nodeLabels": {"rack": "no spaces"}}}, "rack"),
    ("same-label-keys", {"schedulingPolicy": {"nodeLabels": {"gpuModel": "ringwright.dev/rack"}}},
     "three different"),
    ("unknown-policy-field", {"schedulingPolicy": {"packing": "Required"}}, "packing"),
    ("sa-without-name", {"serviceAccount": {"create": False}}, "serviceAccount.name"),
    ("metrics-interval", {"metrics": {"port": 9400, "serviceMonitor": {
        "enabled": True, "interval": "soon"}}}, "interval"),
    ("metrics-unknown-key", {"metrics": {"port": 9400, "grafana": True}}, "grafana"),
]


@pytest.mark.parametrize(("values", "names"), [(v, n) for _, v, n in _BAD_VALUES],
                         ids=[i for i, _, _ in _BAD_VALUES])
def test_bad_values_are_refused_naming_the_field(
    helm: Path, tmp_path: Path, values: Obj, names: str
) -> None:
    assert names in render_error(helm, tmp_path, values)


# ------------------------------------------------------------------ Dockerfile


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, command: str) -> list[str]:
        return [arg for cmd, arg in self.instructions if cmd == command]


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages, with continuation lines joined."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        cmd, _, rest = line.partition(" ")
        cmd = cmd.upper()
        if cmd == "FROM":
            words = [w for w in rest.split() if not w.startswith("--")]
            base = words[0]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(name, base))
        elif not stages:
            if cmd == "ARG":
                key, _, default = rest.partition("=")
                args[key.strip()] = default.strip().strip('"')
        else:
            stages[-1].instructions.append((cmd, rest.strip()))
    return args, stages


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], dict[str, Stage]]:
    args, stages = parse_dockerfile((REPO / "Dockerfile").read_text())
    return args, {s.name: s for s in stages}


def ancestry(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and every stage it builds on or copies from."""
    seen: list[Stage] = []
    todo = [name]
    while todo:
        stage = stages[todo.pop()]
        if stage in seen:
            continue
        seen.append(stage)
        if stage.base in stages:
            todo.append(stage.base)
        for copy in stage.all("COPY"):
            if m := re.search(r"--from=(\S+)", copy):
                todo.append(m.group(1))
        for run in stage.all("RUN"):  # RUN --mount=type=bind,from=<stage>
            todo.extend(f for f in re.findall(r"[,=]from=([\w.-]+)", run) if f in stages)
    return seen


def base_image(args: dict[str, str], stages: dict[str, Stage], name: str) -> str:
    base = stages[name].base
    while base in stages:
        base = stages[base].base
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)


FINAL_TARGETS = ("operator", "training", "training-horovod")


@pytest.mark.parametrize("target", FINAL_TARGETS)
def test_final_images_run_as_a_numeric_non_root_user(
    dockerfile: tuple[dict[str, str], dict[str, Stage]], target: str
) -> None:
    args, stages = dockerfile
    assert base_image(args, stages, target).startswith("python:3.11-slim")
    users = stages[target].all("USER")
    assert users, f"{target} sets no USER: it would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"{target} runs as {users[-1]!r}"


def _pip_installs(stage: Stage) -> list[str]:
    commands = []
    for run in stage.all("RUN"):
        for part in re.split(r"&&|;|\|\|", run):
            if "pip install" in part:
                commands.append(part.strip())
    return commands


def test_operator_image_installs_the_base_package_without_torch(
    dockerfile: tuple[dict[str, str], dict[str, Stage]],
) -> None:
    _, stages = dockerfile
    chain = ancestry(stages, "operator")
    installs = [cmd for stage in chain for cmd in _pip_installs(stage)]
    assert installs, "the operator image installs nothing"
    for cmd in installs:
        assert "torch" not in cmd and "[" not in cmd, f"operator image installs extras: {cmd}"
    # The build itself fails if a dependency ever brings torch in.
    assert any("find_spec('torch')" in run for stage in chain for run in stage.all("RUN"))
    entry = json.loads(stages["operator"].all("ENTRYPOINT")[-1])
    assert entry == ["python", "-m", "ringwright.operator"]


def test_training_images_install_the_runtime_and_horovod(
    dockerfile: tuple[dict[str, str], dict[str, Stage]],
) -> None:
    _, stages = dockerfile
    chain = ancestry(stages, "training")
    # The wheel stage writes the base and runtime requirements out; the training venv
    # installs them in a layer of their own, then the project's wheel without deps.
    assert "['optional-dependencies']['runtime']" in " ".join(
        r for s in chain for r in s.all("RUN"))
    assert any("/deps/runtime.txt /tmp/requirements.txt" in c
               for s in chain for c in s.all("COPY"))
    training = " ".join(c for s in chain for c in _pip_installs(s))
    assert "-r /tmp/requirements.txt" in training and "horovod" not in training
    horovod_chain = ancestry(stages, "training-horovod")
    assert "horovod-*.whl" in " ".join(c for s in horovod_chain for c in _pip_installs(s))
    builds = [run for s in horovod_chain for run in s.all("RUN") if "build_horovod.sh" in run]
    assert len(builds) == 1
    # Every option the Dockerfile passes is one the script accepts.
    script = (REPO / "scripts" / "build_horovod.sh").read_text()
    accepted = set(re.findall(r"^\s+(--[a-z-]+)\)", script, re.MULTILINE))
    passed = {w for w in shlex.split(builds[0].split("build_horovod.sh", 1)[1].split("&&")[0])
              if w.startswith("--")}
    assert passed and passed <= accepted, f"unknown options {passed - accepted}"


def _dockerignore_includes(path: str, patterns: list[str]) -> bool:
    """Whether the build context keeps ``path`` (last matching pattern wins; a pattern
    matching a parent folder matches the path, as Docker does)."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    included = True
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw.removeprefix("!").strip("/")
        regex = (re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*", "[^/]*")
                 .replace(r"\?", "[^/]").replace(r"\[", "[").replace(r"\]", "]"))
        if any(re.fullmatch(regex, c) for c in candidates):
            included = negate
    return included


def test_every_copied_path_exists_and_is_in_the_build_context(
    dockerfile: tuple[dict[str, str], dict[str, Stage]],
) -> None:
    _, stages = dockerfile
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    sources: list[str] = []
    for stage in stages.values():
        for copy in stage.all("COPY"):
            if "--from=" in copy:
                continue
            words = [w for w in copy.split() if not w.startswith("--")]
            sources += words[:-1]
    assert sources
    for source in sources:
        assert (REPO / source).exists(), f"Dockerfile copies {source}, which does not exist"
        assert _dockerignore_includes(source, patterns), f".dockerignore leaves out {source}"
    for noise in (".venv/bin/python", ".git/HEAD", "tests/conftest.py",
                  "operator/__pycache__/x.pyc", "devcluster/go/kube/go.mod"):
        assert not _dockerignore_includes(noise, patterns), f".dockerignore lets {noise} in"


def test_wheel_stage_copies_every_package_folder(
    dockerfile: tuple[dict[str, str], dict[str, Stage]],
) -> None:
    """`pip install .` in the image needs every folder pyproject.toml maps to a package."""
    _, stages = dockerfile
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    readme = pyproject["project"].get("readme")
    needed = folders | ({readme} if readme else set())
    copied = {w.strip("/") for copy in stages["wheel"].all("COPY") for w in copy.split()[:-1]}
    missing = {p for p in needed if not any(p == c or p.startswith(c + "/") for c in copied)}
    assert not missing, f"the wheel stage does not copy {sorted(missing)}"
