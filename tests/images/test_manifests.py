"""The example manifests run what the training image carries, where it can write."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from ringwright.devcluster.build_context import context_files
from ringwright.devcluster.images import ROOT

MANIFESTS = sorted((ROOT / "examples").glob("*.yaml"))
IN_IMAGE = Path("/app/examples")
"""Where the Dockerfile's training stage copies examples/."""


def _templates(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    spec = manifest["spec"]
    return [spec[role]["template"]["spec"] for role in ("workers", "ps") if role in spec]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_script_a_manifest_runs_travels_in_the_image(path: Path) -> None:
    assert "COPY examples/ /app/examples/" in (ROOT / "Dockerfile").read_text()
    shipped = set(context_files(ROOT))
    for template in _templates(yaml.safe_load(path.read_text())):
        for container in template["containers"]:
            scripts = [Path(a) for a in container["command"] if a.startswith(f"{IN_IMAGE}/")]
            assert scripts, f"{path.name}: {container['name']} runs no script of the image"
            for script in scripts:
                assert f"examples/{script.relative_to(IN_IMAGE)}" in shipped


def test_the_demo_checkpoints_to_a_mounted_volume() -> None:
    manifest = yaml.safe_load((ROOT / "examples" / "trainingjob-demo.yaml").read_text())
    path = manifest["spec"]["checkpoint"]["path"]
    for template in _templates(manifest):
        volumes = {v["name"] for v in template["volumes"]}
        for container in template["containers"]:
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert mounts.get(path) in volumes
        assert template["securityContext"]["fsGroup"] == 10001
