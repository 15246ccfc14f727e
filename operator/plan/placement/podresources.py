"""The resources the operator gives each role's containers.

Workers get the job's GPUs on their first (training) container. ps pods get
Guaranteed QoS with whole CPUs in every container, so a kubelet running the static
CPU manager policy pins them to dedicated cores. The planner sizes pods with the same
functions the pod builders use, so what it plans for is what gets created.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from ...api.schedulingpolicy import PSPinning
from .resources import millicores


def worker_container_resources(
    resources: Mapping[str, Any] | None, gpus: int, gpu_resource: str
) -> dict[str, Any]:
    """A worker's training-container ``resources``: the template's, with exactly ``gpus`` GPUs."""
    res = resources or {}
    requests = {k: v for k, v in (res.get("requests") or {}).items() if k != gpu_resource}
    limits = {k: v for k, v in (res.get("limits") or {}).items() if k != gpu_resource}
    if gpus:
        # Extended resources cannot be overcommitted: request and limit must match.
        requests[gpu_resource] = limits[gpu_resource] = str(gpus)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def ps_container_resources(
    resources: Mapping[str, Any] | None, pinning: PSPinning
) -> dict[str, Any]:
    """A ps container's ``resources``: whole CPUs, limits equal to requests (Guaranteed).

    The CPU is the larger of request and limit, rounded up to whole cores; missing
    CPU or memory comes from the policy's defaults.
    """
    res = copy.deepcopy(dict(resources or {}))
    if not pinning.enabled:
        return res
    requests = dict(res.get("requests") or {})
    limits = dict(res.get("limits") or {})
    cpu_values = [millicores(v["cpu"]) for v in (requests, limits) if "cpu" in v]
    cores = -(-max(cpu_values) // 1000) if cpu_values else pinning.default_cpus
    merged = {**limits, **requests}
    merged["cpu"] = str(max(cores, 1))
    merged.setdefault("memory", pinning.default_memory)
    return {"requests": merged, "limits": dict(merged)}


def worker_pod_spec(
    pod_spec: Mapping[str, Any], gpus: int, gpu_resource: str
) -> dict[str, Any]:
    """A copy of a worker template's pod spec with the job's GPUs on the first container."""
    spec = copy.deepcopy(dict(pod_spec))
    first = spec["containers"][0]
    first["resources"] = worker_container_resources(first.get("resources"), gpus, gpu_resource)
    return spec


def ps_pod_spec(pod_spec: Mapping[str, Any], pinning: PSPinning) -> dict[str, Any]:
    """A copy of a ps template's pod spec with every container Guaranteed, whole CPUs.

    Init containers too: a pod is Guaranteed only when all its containers are.
    """
    spec = copy.deepcopy(dict(pod_spec))
    for key in ("initContainers", "containers"):
        for container in spec.get(key) or ():
            container["resources"] = ps_container_resources(container.get("resources"), pinning)
    return spec
