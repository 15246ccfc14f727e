"""The generated CRDs: current, structural, consistent with the models, strict on bad input.

The API server itself is exercised by the cluster tests; here the same schema is
checked offline: OpenAPI-level constraints through the pydantic models (which the
schema is generated from) and the CEL rules through a CEL interpreter, after
applying the schema's defaults the way the API server does.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from ringwright.objects import Obj
from ringwright.operator.api import crdgen
from ringwright.operator.api.base import VALIDATIONS
from ringwright.operator.api.models import TrainingJob
from ringwright.operator.api.schedulingpolicy import SchedulingPolicy

ROOT = Path(__file__).resolve().parents[3]
INVALID = ROOT / "tests" / "data" / "invalid"

TRAINER = {"spec": {"containers": [{"name": "trainer", "image": "busybox"}]}}
MINIMAL_JOB: Obj = {
    "apiVersion": "ringwright.dev/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "demo"},
    "spec": {"workers": {"replicas": 4, "template": TRAINER}},
}
PS_JOB: Obj = {
    **MINIMAL_JOB,
    "spec": {
        "mode": "ParameterServer",
        "backend": "horovod",
        "workers": {"min": 2, "max": 8, "replicas": 4, "template": TRAINER},
        "ps": {"replicas": 2, "template": TRAINER, "consistency": "Async", "staleness": 8,
               "requeueStale": True},
        "gpusPerWorker": 8,
        "gpuModel": "NVIDIA-H100-80GB-HBM3",
        "topology": {"rackPacking": "Preferred", "maxRacks": 2},
        "checkpoint": {"path": "/ckpt", "intervalSteps": 500, "keep": 2},
        "lrScaling": {"rule": "sqrt", "baseWorldSize": 8, "warmupSteps": 100},
        "runPolicy": {"suspend": True, "activeDeadlineSeconds": 3600},
        "schedulingPolicyName": "fast-racks",
    },
}
PS_SYNC_JOB: Obj = {
    **MINIMAL_JOB,
    "spec": {
        "mode": "ParameterServer",
        "workers": {"replicas": 4, "template": TRAINER},
        "ps": {"replicas": 1, "template": TRAINER, "consistency": "Sync", "backupWorkers": 3},
    },
}
S3_JOB: Obj = {
    **MINIMAL_JOB,
    "spec": {
        **MINIMAL_JOB["spec"],
        "checkpoint": {"path": "s3://models/demo", "credentialsSecret": "s3-creds",
                       "endpoint": "http://minio.storage:9000", "region": "eu-west-1",
                       "intervalSteps": 100},
    },
}
POLICY: Obj = {
    "apiVersion": "ringwright.dev/v1alpha1",
    "kind": "SchedulingPolicy",
    "metadata": {"name": "default"},
}


@functools.cache
def _schema(kind: str) -> Obj:
    build = crdgen.trainingjob_crd if kind == "TrainingJob" else crdgen.schedulingpolicy_crd
    schema: Obj = build()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def _model(kind: str) -> type[BaseModel]:
    return TrainingJob if kind == "TrainingJob" else SchedulingPolicy


def _nodes(schema: Obj, path: str = "") -> Iterator[tuple[str, Obj]]:
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from _nodes(sub, f"{path}.{name}")
    if "items" in schema:
        yield from _nodes(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _nodes(schema["additionalProperties"], f"{path}{{}}")


def _resolve(schema: Obj, json_path: str) -> Obj:
    node = schema
    for part in json_path.strip(".").split("."):
        node = node["properties"][part]
    return node


def apply_defaults(schema: Obj, value: Any) -> Any:
    """Fill in schema defaults top-down, as the API server does when it decodes."""
    if isinstance(value, dict) and "properties" in schema:
        out = dict(value)
        for name, sub in schema["properties"].items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = apply_defaults(sub, out[name])
        return out
    if isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], v) for v in value]
    return value


@functools.cache
def _program(rule: str) -> Any:
    celpy = pytest.importorskip("celpy")
    env = celpy.Environment()
    return env.program(env.compile(rule))


def cel_errors(schema: Obj, new: Any, old: Any = None, path: str = "") -> list[str]:
    """Messages of the CEL rules ``new`` breaks; transition rules only when ``old`` is given."""
    celpy = pytest.importorskip("celpy")
    errors = []
    for rule in schema.get(VALIDATIONS, []):
        activation = {"self": celpy.json_to_cel(new)}
        if "oldSelf" in rule["rule"]:
            if old is None:
                continue
            activation["oldSelf"] = celpy.json_to_cel(old)
        where = path.lstrip(".") or "<root>"
        try:
            result = _program(rule["rule"]).evaluate(activation)
        except celpy.CELEvalError as err:
            # The API server reports a rule that cannot run (a missing field) as an error too.
            errors.append(f"{where}: {rule['message']} ({err.args[0]})")
            continue
        if not bool(result):
            errors.append(f"{where}: {rule['message']}")
    if isinstance(new, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in new:
                before = old.get(name) if isinstance(old, dict) else None
                errors += cel_errors(sub, new[name], before, f"{path}.{name}")
    return errors


def refusals(kind: str, manifest: Obj, old: Obj | None = None) -> list[str]:
    """Every error the schema has for ``manifest`` (an update of ``old`` when given)."""
    errors = []
    try:
        _model(kind).model_validate(manifest)
    except ValidationError as err:
        errors += [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()]
    schema = _schema(kind)
    defaulted_old = apply_defaults(schema, old) if old is not None else None
    return errors + cel_errors(schema, apply_defaults(schema, manifest), defaulted_old)


def _cases(file: str) -> list[Any]:
    cases = yaml.safe_load((INVALID / file).read_text())["cases"]
    return [pytest.param(c, id=c["name"]) for c in cases]


# --- the files on disk ---------------------------------------------------------------


def test_crds_on_disk_match_the_models() -> None:
    for name, text in crdgen.render().items():
        path = ROOT / "crds" / name
        assert path.is_file(), f"{path} missing: run python -m ringwright.operator.api.crdgen"
        assert path.read_text() == text, f"{path} is stale: regenerate with crdgen"


def test_check_mode_reports_stale_then_current(tmp_path: Path) -> None:
    assert crdgen.main(["--check", "--out", str(tmp_path)]) == 1
    assert crdgen.main(["--out", str(tmp_path)]) == 0
    assert crdgen.main(["--check", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(crdgen.CRDS)


# --- structure -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["TrainingJob", "SchedulingPolicy"])
def test_schema_is_structural_and_described(kind: str) -> None:
    for path, node in _nodes(_schema(kind)):
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path}: no type"
        assert not {"$ref", "anyOf", "allOf", "oneOf", "not", "title"} & node.keys(), path
        assert not ("properties" in node and "additionalProperties" in node), path
        if path not in (".metadata",) and not path.endswith(("[]", "{}")):
            assert node.get("description"), f"{path}: no description"
        for rule in node.get(VALIDATIONS, []):
            assert rule["message"].startswith(("spec.", "metadata.")), rule
        if path.startswith(".status"):
            assert "default" not in node, f"{path}: status fields take no defaults"


def test_cel_rules_sit_outside_lists() -> None:
    # Rules inside list items would need list-type correlation to run as transition
    # rules, and cost more; none are wanted there.
    for kind in ("TrainingJob", "SchedulingPolicy"):
        for path, node in _nodes(_schema(kind)):
            if "[]" in path:
                assert VALIDATIONS not in node, path


@pytest.mark.parametrize("kind", ["TrainingJob", "SchedulingPolicy"])
def test_every_default_passes_its_own_rules_as_written(kind: str) -> None:
    # The API server validates a default against the schema and CEL rules without
    # filling in nested defaults first; a bare {} default would break rules there.
    for path, node in _nodes(_schema(kind)):
        if "default" in node:
            assert cel_errors(node, node["default"]) == [], path


def test_subresources_and_columns_point_at_real_fields() -> None:
    crd = crdgen.trainingjob_crd()
    version = crd["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    scale = version["subresources"]["scale"]
    assert _resolve(schema, scale["specReplicasPath"])["type"] == "integer"
    assert _resolve(schema, scale["statusReplicasPath"])["type"] == "integer"
    assert _resolve(schema, scale["labelSelectorPath"])["type"] == "string"
    for kind in ("TrainingJob", "SchedulingPolicy"):
        crd = crdgen.trainingjob_crd() if kind == "TrainingJob" else crdgen.schedulingpolicy_crd()
        version = crd["spec"]["versions"][0]
        for column in version["additionalPrinterColumns"]:
            if column["jsonPath"] != ".metadata.creationTimestamp":
                node = _resolve(_schema(kind), column["jsonPath"])
                assert column["type"] in (node["type"], "string"), column
    names = [c["name"] for c in crdgen.trainingjob_crd()["spec"]["versions"][0][
        "additionalPrinterColumns"] if "priority" not in c]
    assert names == ["Phase", "Ready", "Desired", "Generation", "Racks", "Age"]


def test_names_and_scope() -> None:
    tj = crdgen.trainingjob_crd()["spec"]
    sp = crdgen.schedulingpolicy_crd()["spec"]
    assert (tj["scope"], tj["names"]["plural"], tj["names"]["shortNames"]) == (
        "Namespaced", "trainingjobs", ["tj"])
    assert (sp["scope"], sp["names"]["plural"], sp["names"]["shortNames"]) == (
        "Cluster", "schedulingpolicies", ["sp"])


# --- defaults and valid input --------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "manifest"),
    [("TrainingJob", MINIMAL_JOB), ("TrainingJob", PS_JOB), ("SchedulingPolicy", POLICY)],
    ids=["minimal-job", "ps-job", "empty-policy"],
)
def test_server_defaults_agree_with_model_defaults(kind: str, manifest: Obj) -> None:
    defaulted = apply_defaults(_schema(kind), manifest)
    model = _model(kind).model_validate(defaulted)
    assert model.model_dump(mode="json", by_alias=True, exclude_none=True) == defaulted


def test_empty_policy_gets_documented_defaults() -> None:
    spec = apply_defaults(_schema("SchedulingPolicy"), POLICY)["spec"]
    assert spec["nodeLabels"] == {
        "rack": "ringwright.dev/rack",
        "nvlinkDomain": "nvidia.com/gpu.clique",
        "gpuModel": "nvidia.com/gpu.product",
    }
    assert spec["rackPacking"] == "Required"
    assert spec["priorityClasses"] == {"worker": "ringwright-worker", "ps": "ringwright-ps"}


@pytest.mark.parametrize(
    ("kind", "manifest"),
    [("TrainingJob", MINIMAL_JOB), ("TrainingJob", PS_JOB), ("TrainingJob", PS_SYNC_JOB),
     ("TrainingJob", S3_JOB), ("SchedulingPolicy", POLICY)],
    ids=["minimal-job", "ps-job", "ps-sync-job", "s3-checkpoints", "empty-policy"],
)
def test_valid_manifests_pass_every_rule(kind: str, manifest: Obj) -> None:
    assert refusals(kind, manifest) == []


def test_auto_checkpoint_interval_passes_every_rule() -> None:
    job = copy.deepcopy(MINIMAL_JOB)
    job["spec"]["checkpoint"] = {"path": "/ckpt", "intervalSteps": "Auto", "autoMaxSteps": 500}
    assert refusals("TrainingJob", job) == []


def test_the_parameter_server_example_passes_every_rule() -> None:
    manifest = yaml.safe_load((ROOT / "examples" / "ps_wide_and_deep.yaml").read_text())
    assert refusals("TrainingJob", manifest) == []
    assert manifest["spec"]["ps"]["consistency"] == "Async"


def test_allowed_updates_pass_transition_rules() -> None:
    new = copy.deepcopy(PS_JOB)
    new["spec"]["workers"].update(replicas=8, min=1)
    new["spec"]["runPolicy"] = {"suspend": False}
    new["spec"]["workers"]["template"] = {"spec": {"containers": [{"name": "t", "image": "x:2"}]}}
    assert refusals("TrainingJob", new, old=PS_JOB) == []


def test_ps_replicas_change_within_the_shards() -> None:
    """Servers grow up to spec.ps.shards and shrink; without shards they only shrink."""
    def resized(job: Obj, replicas: int) -> Obj:
        new = copy.deepcopy(job)
        new["spec"]["ps"]["replicas"] = replicas
        return new

    sharded = copy.deepcopy(PS_JOB)
    sharded["spec"]["ps"]["shards"] = 3
    assert refusals("TrainingJob", sharded) == []
    assert refusals("TrainingJob", resized(sharded, 3), old=sharded) == []
    assert refusals("TrainingJob", resized(sharded, 1), old=resized(sharded, 3)) == []
    assert refusals("TrainingJob", resized(PS_JOB, 1), old=PS_JOB) == []


# --- invalid input -------------------------------------------------------------------------


def test_there_are_enough_invalid_cases() -> None:
    total = sum(len(_cases(f)) for f in ("trainingjobs.yaml", "schedulingpolicies.yaml"))
    assert total >= 25


@pytest.mark.parametrize("case", _cases("trainingjobs.yaml") + _cases("schedulingpolicies.yaml"))
def test_invalid_manifest_is_refused_naming_the_field(case: Obj) -> None:
    kind = case["manifest"]["kind"]
    if "old" in case:
        assert refusals(kind, case["old"]) == [], "the original object must be valid"
    errors = refusals(kind, case["manifest"], case.get("old"))
    assert errors, "accepted"
    assert any(case["expect"] in e for e in errors), errors
