"""A simulated datacenter described in YAML, turned into KWOK Node manifests."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

INVENTORY_DIR = Path(__file__).resolve().parent / "inventory"

RACK_LABEL = "ringwright.dev/rack"
NVLINK_LABEL = "nvidia.com/gpu.clique"
GPU_MODEL_LABEL = "nvidia.com/gpu.product"
GPU_RESOURCE = "nvidia.com/gpu"
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
"""KWOK manages the nodes carrying this annotation (value "fake"), and no others."""


class RackGroup(BaseModel):
    """``racks`` identical racks of ``nodesPerRack`` nodes each."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid")

    racks: int = Field(ge=1)
    nodes_per_rack: int = Field(ge=1, alias="nodesPerRack")
    gpus_per_node: int = Field(ge=0, alias="gpusPerNode")
    gpu_model: str = Field(alias="gpuModel")
    nodes_per_nvlink_domain: int = Field(default=1, ge=1, alias="nodesPerNVLinkDomain")
    cpu: str = "64"
    memory: str = "512Gi"
    pods: int = 110


class Inventory(BaseModel):
    model_config = ConfigDict(extra="forbid")

    groups: list[RackGroup]


def load_inventory(name_or_path: str) -> Inventory:
    """Load ``name_or_path``: a file path, or the name of a bundled inventory."""
    path = Path(name_or_path)
    if not path.is_file():
        path = INVENTORY_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        bundled = sorted(p.stem for p in INVENTORY_DIR.glob("*.yaml"))
        raise FileNotFoundError(f"inventory {name_or_path!r} not found; bundled: {bundled}")
    return Inventory.model_validate(yaml.safe_load(path.read_text()))


def pod_cidr(index: int) -> str:
    """A /24 inside 127.0.0.0/8 for node ``index``: every pod IP is a loopback address."""
    return f"127.{10 + index // 256}.{index % 256}.0/24"


def node_ip(index: int) -> str:
    return f"127.1.{index // 250}.{index % 250 + 1}"


def node_manifests(inventory: Inventory) -> list[dict[str, Any]]:
    """Whole Node objects (labels, podCIDR, allocatable) for every simulated node."""
    nodes: list[dict[str, Any]] = []
    rack_index = 0
    for group in inventory.groups:
        for _ in range(group.racks):
            rack = f"rack-{rack_index}"
            rack_index += 1
            for n in range(group.nodes_per_rack):
                index = len(nodes)
                name = f"{rack}-node-{n}"
                resources = {
                    "cpu": group.cpu,
                    "memory": group.memory,
                    "pods": str(group.pods),
                    GPU_RESOURCE: str(group.gpus_per_node),
                }
                nodes.append({
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {
                        "name": name,
                        "labels": {
                            "kubernetes.io/hostname": name,
                            "kubernetes.io/os": "linux",
                            "type": "kwok",
                            RACK_LABEL: rack,
                            NVLINK_LABEL: f"{rack}-nvl-{n // group.nodes_per_nvlink_domain}",
                            GPU_MODEL_LABEL: group.gpu_model,
                        },
                        "annotations": {KWOK_NODE_ANNOTATION: "fake"},
                    },
                    "spec": {"podCIDR": pod_cidr(index), "podCIDRs": [pod_cidr(index)]},
                    "status": {
                        "allocatable": resources,
                        "capacity": resources,
                        "addresses": [{"type": "InternalIP", "address": node_ip(index)}],
                    },
                })
    return nodes


def describe(nodes: list[dict[str, Any]]) -> str:
    """A per-rack table of what the cluster holds (from live Node objects)."""
    racks: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for node in nodes:
        racks[node["metadata"]["labels"].get(RACK_LABEL, "<none>")].append(node)
    lines = [f"{'RACK':<10}{'NODES':>6}{'GPUS':>6}  {'NVLINK DOMAINS':<16}GPU MODEL"]
    for rack in sorted(racks, key=lambda r: (len(r), r)):
        members = racks[rack]
        labels = [m["metadata"]["labels"] for m in members]
        gpus = sum(int(m["status"].get("allocatable", {}).get(GPU_RESOURCE, 0)) for m in members)
        models = sorted({lab.get(GPU_MODEL_LABEL, "") for lab in labels})
        domains = len({lab.get(NVLINK_LABEL, "") for lab in labels})
        lines.append(f"{rack:<10}{len(members):>6}{gpus:>6}  {domains:<16}{', '.join(models)}")
    return "\n".join(lines)
