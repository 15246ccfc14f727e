"""Install ringwright's API into a cluster the quick way (no Helm): CRDs, PriorityClasses
and the default SchedulingPolicy, with the same defaults the chart uses."""

from __future__ import annotations

import time
from pathlib import Path

import yaml

from ringwright.kube import KubeClient, api_path
from ringwright.operator.api.base import API_VERSION
from ringwright.operator.api.schedulingpolicy import SchedulingPolicy

CRD_DIR = Path(__file__).resolve().parents[1] / "crds"
CRDS = "apiextensions.k8s.io/v1"


def _established(kube: KubeClient, name: str) -> bool:
    crd = kube.get(api_path(CRDS, "customresourcedefinitions", name=name))
    return any(c["type"] == "Established" and c["status"] == "True"
               for c in (crd.get("status") or {}).get("conditions") or [])


def install_api(kube: KubeClient, timeout: float = 60.0) -> None:
    """Apply the CRDs, PriorityClasses and a default SchedulingPolicy; idempotent."""
    names = []
    for path in sorted(CRD_DIR.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        names.append(crd["metadata"]["name"])
        kube.apply(api_path(CRDS, "customresourcedefinitions", name=names[-1]), crd)
    deadline = time.monotonic() + timeout
    while not all(_established(kube, n) for n in names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"CRDs {names} not established after {timeout:.0f}s")
        time.sleep(0.2)
    policy = SchedulingPolicy(metadata={"name": "default"})
    classes = policy.spec.priority_classes
    for name, value in ((classes.ps, 1_000_000), (classes.worker, 100_000)):
        kube.apply(api_path("scheduling.k8s.io/v1", "priorityclasses", name=name), {
            "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
            "metadata": {"name": name}, "value": value,
            "description": f"ringwright {name} pods"})
    kube.apply(api_path(API_VERSION, "schedulingpolicies", name="default"), policy.to_wire())
