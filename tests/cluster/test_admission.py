"""Bad input is refused by the real API server, with a message that names the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from ringwright.kube import ApiError, KubeClient, api_path
from ringwright.operator.api.base import API_VERSION

pytestmark = pytest.mark.cluster

DATA = Path(__file__).resolve().parents[1] / "data" / "invalid"


def _cases(file: str) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = yaml.safe_load((DATA / file).read_text())["cases"]
    return cases


def _replace_latest(kube: KubeClient, path: str, manifest: dict[str, Any]) -> None:
    """PUT ``manifest`` over the latest version (a running operator may write in between)."""
    for _ in range(10):
        version = kube.get(path)["metadata"]["resourceVersion"]
        try:
            kube.replace(path, {**manifest, "metadata": {**manifest["metadata"],
                                                         "resourceVersion": version}})
        except ApiError as err:
            if err.status != 409:
                raise
            continue
        return


def _refused(kube: KubeClient, collection: str, case: dict[str, Any]) -> str:
    manifest = case["manifest"]
    name = manifest["metadata"]["name"]
    with pytest.raises(ApiError) as refused:
        if "old" in case:
            kube.create(collection, case["old"])
            _replace_latest(kube, f"{collection}/{name}", manifest)
        else:
            kube.create(collection, manifest)
    assert refused.value.status == 422, refused.value
    return refused.value.message


@pytest.mark.parametrize("case", _cases("trainingjobs.yaml"), ids=lambda c: c["name"])
def test_invalid_trainingjob_is_refused_naming_the_field(
    kube: KubeClient, api: None, namespace: str, case: dict[str, Any]
) -> None:
    message = _refused(kube, api_path(API_VERSION, "trainingjobs", namespace), case)
    assert case["expect"] in message


@pytest.mark.parametrize("case", _cases("schedulingpolicies.yaml"), ids=lambda c: c["name"])
def test_invalid_schedulingpolicy_is_refused_naming_the_field(
    kube: KubeClient, api: None, case: dict[str, Any]
) -> None:
    collection = api_path(API_VERSION, "schedulingpolicies")
    try:
        message = _refused(kube, collection, case)
    finally:
        kube.delete(f"{collection}/{case['manifest']['metadata']['name']}")
    assert case["expect"] in message


def test_at_least_25_invalid_manifests() -> None:
    assert len(_cases("trainingjobs.yaml")) + len(_cases("schedulingpolicies.yaml")) >= 25
