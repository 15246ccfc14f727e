"""The example job, ``examples/trainingjob-demo.yaml``, and the one overlay the real-node
runs add to it, as a user's kustomization would."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ringwright.objects import Obj

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "trainingjob-demo.yaml"
LONG_EPOCHS = 100_000
"""Epochs that outlast any run here: the example's 20 end within a minute on CPU, before
a deleted worker's replacement can rejoin."""


def example() -> dict[str, Any]:
    """The example manifest as written."""
    manifest: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    return manifest


def training_container(manifest: Obj) -> Obj:
    """The example's one worker container."""
    (container,) = manifest["spec"]["workers"]["template"]["spec"]["containers"]
    return container  # type: ignore[no-any-return]


def with_epochs(manifest: Obj, epochs: int) -> Obj:
    """``manifest`` with ``args: [--epochs, <epochs>]`` on its training container: what
    :func:`kustomization` adds."""
    training_container(manifest)["args"] = ["--epochs", str(epochs)]
    return manifest


def kustomization(epochs: int) -> str:
    """A user's ``kustomization.yaml`` beside the example that does what
    :func:`with_epochs` does (``kubectl apply -k`` its folder)."""
    return f"""resources:
  - {EXAMPLE.name}
patches:
  - target: {{kind: TrainingJob, name: resnet}}
    patch: |-
      - op: add
        path: /spec/workers/template/spec/containers/0/args
        value: [--epochs, "{epochs}"]
"""
