"""NOTES.txt as `helm install` prints it: every command in it names the release's
namespace, objects, ports, labels and files as the chart renders them, so it works
when pasted.
"""

from __future__ import annotations

import shlex
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from ringwright.devcluster.helm import CHART
from ringwright.devcluster.versions import KUBERNETES
from ringwright.objects import Obj
from tests.unit.test_chart_render import (
    CHART_CRDS,
    RELEASE,
    RELEASE_NS,
    REPO,
    by_kind,
    helm,
    one,
    render,
    run_helm,
)

__all__ = ["helm"]  # the fixture, shared with the chart render tests

DEMO = "examples/trainingjob-demo.yaml"
BUILTIN = {"deployment": "Deployment", "node": "Node"}
"""The built-in resources the notes name, as kubectl spells them."""


_NOTES_PROBE = """\
apiVersion: v1
kind: ConfigMap
metadata:
  name: notes
data:
  notes: {{ tpl (.Files.Get "NOTES.under-test") . | toJson }}
"""


def render_notes(helm: Path, tmp: Path, values: Obj | None = None) -> str:
    """NOTES.txt rendered for a release, without a cluster.

    helm 3's `install --dry-run=client` still dials the cluster (helm/helm#13144) and
    `helm template` leaves the notes out, so a copy of the chart renders them through
    `tpl`, with the same values, release and helpers; the cluster test checks what a
    real `helm install` prints.
    """
    chart = tmp / "chart"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "NOTES.txt").rename(chart / "NOTES.under-test")
    (chart / "templates" / "notes-probe.yaml").write_text(_NOTES_PROBE)
    args = ["template", RELEASE, str(chart), "--namespace", RELEASE_NS,
            "--kube-version", KUBERNETES, "--show-only", "templates/notes-probe.yaml"]
    if values is not None:
        (tmp / "notes-values.yaml").write_text(yaml.safe_dump(values))
        args += ["--values", str(tmp / "notes-values.yaml")]
    proc = run_helm(helm, *args)
    assert proc.returncode == 0, proc.stderr
    notes: str = yaml.safe_load(proc.stdout)["data"]["notes"]
    shutil.rmtree(chart)
    return notes


@dataclass
class Command:
    """One shell command of the notes, its words split the way a shell would."""

    line: str
    words: list[str]
    options: dict[str, str] = field(default_factory=dict)
    flags: set[str] = field(default_factory=set)
    args: list[str] = field(default_factory=list)


# kubectl options that take a value as the next word.
_VALUED = {"-n", "--namespace", "-l", "--selector", "-f", "--filename", "-o", "--output"}


def commands(notes: str) -> list[Command]:
    """The indented command lines (kubectl, curl), comments and `&` dropped."""
    found = []
    for line in notes.splitlines():
        stripped = line.strip()
        if not line.startswith("     ") or stripped.split(" ")[0] not in ("kubectl", "curl"):
            continue
        words = [w for w in shlex.split(stripped, comments=True) if w != "&"]
        cmd = Command(stripped, words)
        rest = iter(words[1:])
        for word in rest:
            if word in _VALUED:
                cmd.options[word.lstrip("-")[0]] = next(rest)
            elif word.startswith("-"):
                cmd.flags.add(word)
            else:
                cmd.args.append(word)
        found.append(cmd)
    return found


@dataclass
class Target:
    """What the commands may name: the release's objects, plus the ones they create."""

    objs: list[Obj]
    crds: list[Obj]
    served: list[str]
    """Namespaces whose jobs the operator serves; empty: every namespace."""
    exists: Callable[[str, str | None, str], bool]
    applied: dict[tuple[str, str | None, str], Obj] = field(default_factory=dict)

    def kind(self, word: str) -> str:
        word = word.split(".")[0]
        if word in BUILTIN:
            return BUILTIN[word]
        for crd in self.crds:
            names = crd["spec"]["names"]
            if word in (names["plural"], names["singular"], *names.get("shortNames", [])):
                kind: str = names["kind"]
                return kind
        raise AssertionError(f"kubectl knows no resource {word!r}")

    def crd(self, kind: str) -> Obj:
        return next(c for c in self.crds if c["spec"]["names"]["kind"] == kind)

    def namespaced(self, kind: str) -> bool:
        return kind == "Deployment" or kind in {c["spec"]["names"]["kind"] for c in self.crds
                                                if c["spec"]["scope"] == "Namespaced"}


def _typed_name(word: str) -> tuple[str, str]:
    """``deployment/x`` -> (deployment, x)."""
    kind, _, name = word.partition("/")
    return kind, name


def check_command(cmd: Command, target: Target, previous: Command | None) -> None:
    """Fail when ``cmd`` would not work against ``target``."""
    if cmd.words[0] == "curl":
        assert previous is not None and "port-forward" in previous.args, cmd.line
        port = previous.args[-1].split(":")[0]
        assert cmd.args[0].startswith(f"localhost:{port}/"), cmd.line
        return
    namespace = cmd.options.get("n")
    verb, *rest = cmd.args
    targets: list[tuple[str, str]] = []
    if verb == "rollout":
        assert rest[0] == "status", cmd.line
        targets.append(_typed_name(rest[1]))
    elif verb in ("get", "describe"):
        targets.append((rest[0], rest[1]) if len(rest) > 1 else (rest[0], ""))
    elif verb in ("scale", "port-forward"):
        targets.append(_typed_name(rest[0]))
    elif verb == "explain":
        kind = target.kind(rest[0])
        schema = target.crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for part in rest[0].split(".")[1:]:
            assert part in schema["properties"], cmd.line
            schema = schema["properties"][part]
    elif verb == "label":
        assert rest[0] == "node" and rest[1].isupper(), cmd.line  # NODE: a placeholder
        keys = {label.split("=", 1)[0] for label in rest[2:]}
        policy = one(target.objs, "SchedulingPolicy")["spec"]["nodeLabels"]
        assert keys == {policy[k] for k in ("rack", "nvlinkDomain", "gpuModel")}, cmd.line
    elif verb == "logs":
        selector = dict(p.split("=", 1) for p in cmd.options["l"].split(","))
        deployment = one(target.objs, "Deployment")
        assert namespace == deployment["metadata"]["namespace"], cmd.line
        assert selector == deployment["spec"]["selector"]["matchLabels"], cmd.line
        assert target.exists("Deployment", namespace, deployment["metadata"]["name"])
    elif verb == "apply":
        path = cmd.options["f"]
        if "--server-side" in cmd.flags:  # the CRDs, from the chart or the repository
            assert path.rstrip("/") == CHART_CRDS.name and CHART_CRDS.is_dir(), cmd.line
            assert (REPO / path).is_dir(), cmd.line
            assert "--force-conflicts" in cmd.flags, "helm owns the CRDs' fields"
            return
        obj = yaml.safe_load((REPO / path).read_text())
        assert obj["kind"] == "TrainingJob", cmd.line
        _check_job_namespace(cmd, target)
        target.applied[(obj["kind"], namespace, obj["metadata"]["name"])] = obj
    else:
        raise AssertionError(f"no check for {cmd.line}")
    for word, name in targets:
        kind = target.kind(word)
        if kind == "TrainingJob":
            _check_job_namespace(cmd, target)
        elif target.namespaced(kind):
            assert namespace, f"{cmd.line}: no namespace"
        if not name:
            continue
        key = (kind, namespace if target.namespaced(kind) else None, name)
        assert key in target.applied or target.exists(*key), f"{cmd.line}: no {key}"
        if verb == "scale":
            assert target.crd(kind)["spec"]["versions"][0]["subresources"]["scale"]
            job = target.applied[key]["spec"]["workers"]
            replicas = int(next(f for f in cmd.flags if f.startswith("--replicas=")).split("=")[1])
            assert job["min"] <= replicas <= job["max"], cmd.line
        if verb == "port-forward":
            deployment = one(target.objs, kind, name)
            ports = {p["containerPort"] for c in deployment["spec"]["template"]["spec"]
                     ["containers"] for p in c["ports"]}
            assert int(rest[1].split(":")[-1]) in ports, cmd.line


def _check_job_namespace(cmd: Command, target: Target) -> None:
    """A job goes where the operator serves it (with every namespace served, anywhere)."""
    if target.served:
        assert cmd.options.get("n") in target.served, (
            f"{cmd.line}: the operator serves {target.served}")


def check_notes(notes: str, target: Target) -> list[Command]:
    """Check every command of ``notes``; returns them."""
    found = commands(notes)
    previous = None
    for cmd in found:
        check_command(cmd, target, previous)
        previous = cmd
    return found


def chart_crds() -> list[Obj]:
    return [yaml.safe_load(p.read_text()) for p in sorted(CHART_CRDS.glob("*.yaml"))]


def rendered_target(objs: list[Obj], served: list[str]) -> Target:
    def exists(kind: str, namespace: str | None, name: str) -> bool:
        return any(o["kind"] == kind and o["metadata"].get("namespace") == namespace
                   and o["metadata"]["name"] == name for o in objs)
    return Target(objs, chart_crds(), served, exists)


# ------------------------------------------------------------------ tests

_CASES: list[tuple[str, Obj]] = [
    ("defaults", {}),
    ("namespace-list", {"operator": {"watchNamespaces": ["team-a", "team-b"]}}),
    ("renamed", {"fullnameOverride": "ml-ops", "metrics": {"port": 9500},
                 "schedulingPolicy": {"name": "gpu-pool",
                                      "nodeLabels": {"rack": "example.com/rack"}}}),
    ("no-metrics-no-policy", {"metrics": {"port": 0}, "schedulingPolicy": {"create": False}}),
]


@pytest.mark.parametrize("values", [v for _, v in _CASES], ids=[i for i, _ in _CASES])
def test_notes_commands_name_the_rendered_objects(
    helm: Path, tmp_path: Path, values: Obj
) -> None:
    notes = render_notes(helm, tmp_path, values)
    objs = render(helm, tmp_path, values)
    served = values.get("operator", {}).get("watchNamespaces", [])
    found = check_notes(notes, rendered_target(objs, served))
    verbs = {c.args[0] for c in found if c.words[0] == "kubectl"}
    assert {"rollout", "logs", "apply", "get", "describe", "scale"} <= verbs
    assert f"release {RELEASE} in namespace {RELEASE_NS}" in notes
    metrics = values.get("metrics", {}).get("port", 9400)
    assert any("port-forward" in c.args for c in found) == bool(metrics)
    if by_kind(objs, "SchedulingPolicy"):
        assert "label" in verbs


def test_notes_say_which_policy_the_demo_uses(helm: Path, tmp_path: Path) -> None:
    renamed = render_notes(helm, tmp_path, {"schedulingPolicy": {"name": "gpu-pool"}})
    demo = yaml.safe_load((REPO / DEMO).read_text())
    assert "schedulingPolicyName" not in demo["spec"], "the demo names a policy now"
    assert "spec.schedulingPolicyName: gpu-pool" in " ".join(renamed.split())
    assert "schedulingPolicyName" not in render_notes(helm, tmp_path)


def test_notes_name_kueues_gates_for_elastic_topology(helm: Path, tmp_path: Path) -> None:
    on = render_notes(helm, tmp_path, {"operator": {"settings": {
        "kueue": True, "kueueElastic": True, "kueueElasticTopology": True}}})
    text = " ".join(on.split())
    assert "ElasticJobsViaWorkloadSlices=true,ElasticJobsViaWorkloadSlicesWithTAS=true" in text
    assert "TopologyAssigned=False" in text
    assert "ElasticJobsViaWorkloadSlicesWithTAS" not in render_notes(helm, tmp_path)


def test_the_check_refuses_a_wrong_command(helm: Path, tmp_path: Path) -> None:
    """The checker itself: each kind of mistake the notes could make is caught."""
    objs = render(helm, tmp_path)
    wrong = [
        f"     kubectl -n default rollout status deployment/{RELEASE}-ringwright",
        f"     kubectl -n {RELEASE_NS} rollout status deployment/ringwright",
        f"     kubectl -n {RELEASE_NS} logs -l app.kubernetes.io/name=ringwright --prefix",
        "     kubectl get schedulingpolicy gpu-pool -o yaml",
        "     kubectl label node NODE ringwright.dev/rack=RACK",
        "     kubectl explain trainingjob.spec.nope",
        "     kubectl apply --server-side -f crds/",
        f"     kubectl -n {RELEASE_NS} port-forward deployment/{RELEASE}-ringwright 9401 &",
    ]
    for line in wrong:
        with pytest.raises(AssertionError):
            check_notes(line, rendered_target(objs, []))
    scaled = ("     kubectl apply -f examples/trainingjob-demo.yaml\n"
              "     kubectl scale tj/resnet --replicas=20\n")
    with pytest.raises(AssertionError):
        check_notes(scaled, rendered_target(objs, []))
    confined = "     kubectl apply -f examples/trainingjob-demo.yaml\n"
    with pytest.raises(AssertionError):
        check_notes(confined, rendered_target(objs, ["team-a"]))
