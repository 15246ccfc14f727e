"""Resource quantities: parsing Kubernetes quantities and summing what pods request.

The planner compares integers (millicores, bytes, GPUs, pod slots), so quantities are
parsed once, exactly (``Decimal``), and rounded up: a pod never gets less than it asked.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

_QUANTITY = re.compile(r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+))([eE][+-]?\d+|[KMGTPE]i|[numkMGTPE])?$")
_SUFFIX = {
    "": Decimal(1),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
}


def parse_quantity(value: str | int | float) -> Decimal:
    """The exact value of a Kubernetes quantity such as ``"500m"``, ``"8Gi"`` or ``"1e3"``."""
    if isinstance(value, int | float):
        return Decimal(str(value))
    return _parse(value)


@functools.lru_cache(maxsize=4096)
def _parse(value: str) -> Decimal:
    # A cluster repeats a handful of quantities across thousands of nodes and pods.
    match = _QUANTITY.match(value.strip())
    if match is None:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    number, suffix = match.group(1), match.group(2) or ""
    if suffix[:1] in ("e", "E"):
        return Decimal(number) * Decimal(10) ** int(suffix[1:])
    return Decimal(number) * _SUFFIX[suffix]


def millicores(value: str | int | float) -> int:
    """CPU quantity in millicores, rounded up."""
    if isinstance(value, str):
        return _millicores(value)
    return math.ceil(parse_quantity(value) * 1000)


def whole(value: str | int | float) -> int:
    """A quantity (bytes, GPUs, pods) as an integer, rounded up."""
    if isinstance(value, str):
        return _whole(value)
    return math.ceil(parse_quantity(value))


@functools.lru_cache(maxsize=4096)
def _millicores(value: str) -> int:
    return math.ceil(_parse(value) * 1000)


@functools.lru_cache(maxsize=4096)
def _whole(value: str) -> int:
    return math.ceil(_parse(value))


@dataclass(frozen=True, slots=True)
class Resources:
    """A vector of the resources placement counts."""

    cpu_milli: int = 0
    memory: int = 0
    """Bytes."""
    gpus: int = 0
    pods: int = 0

    def __add__(self, other: Resources) -> Resources:
        return Resources(
            self.cpu_milli + other.cpu_milli,
            self.memory + other.memory,
            self.gpus + other.gpus,
            self.pods + other.pods,
        )

    def __sub__(self, other: Resources) -> Resources:
        return Resources(
            self.cpu_milli - other.cpu_milli,
            self.memory - other.memory,
            self.gpus - other.gpus,
            self.pods - other.pods,
        )

    def times(self, n: int) -> Resources:
        """``n`` copies of this vector."""
        return Resources(self.cpu_milli * n, self.memory * n, self.gpus * n, self.pods * n)

    def max(self, other: Resources) -> Resources:
        """Element-wise maximum."""
        return Resources(
            max(self.cpu_milli, other.cpu_milli),
            max(self.memory, other.memory),
            max(self.gpus, other.gpus),
            max(self.pods, other.pods),
        )

    def count_fitting(self, each: Resources) -> int:
        """How many pods needing ``each`` fit into this much free room (never negative)."""
        # Plain comparisons, not min() over tuples: the planner calls this per node.
        if each.pods <= 0:
            raise ValueError("a pod must request at least one pod slot")
        n = self.pods // each.pods
        if each.cpu_milli and self.cpu_milli // each.cpu_milli < n:
            n = self.cpu_milli // each.cpu_milli
        if each.memory and self.memory // each.memory < n:
            n = self.memory // each.memory
        if each.gpus and self.gpus // each.gpus < n:
            n = self.gpus // each.gpus
        return n if n > 0 else 0

    def describe(self) -> str:
        """Short human form, e.g. ``2 GPU, 8 CPU, 64Gi``."""
        parts = []
        if self.gpus:
            parts.append(f"{self.gpus} GPU")
        parts.append(f"{self.cpu_milli / 1000:g} CPU")
        parts.append(f"{self.memory / 1024**3:.4g}Gi")
        return ", ".join(parts)


def from_resource_list(values: Mapping[str, Any], gpu_resource: str) -> Resources:
    """Resources of a ``requests`` / ``limits`` / ``allocatable`` map (pods only if listed)."""
    return Resources(
        cpu_milli=millicores(values["cpu"]) if "cpu" in values else 0,
        memory=whole(values["memory"]) if "memory" in values else 0,
        gpus=whole(values[gpu_resource]) if gpu_resource in values else 0,
        pods=whole(values["pods"]) if "pods" in values else 0,
    )


def container_requests(container: Mapping[str, Any], gpu_resource: str) -> Resources:
    """What one container requests; a resource with only a limit requests that limit."""
    res = container.get("resources") or {}
    merged = {**(res.get("limits") or {}), **(res.get("requests") or {})}
    return from_resource_list(merged, gpu_resource)


def pod_requests(pod_spec: Mapping[str, Any], gpu_resource: str) -> Resources:
    """What a pod takes from a node, computed as the scheduler does.

    Containers run together, so they add up. Init containers run one at a time
    before them, each alongside the sidecars (``restartPolicy: Always``) started
    before it; sidecars keep running with the containers. Plus the pod's declared
    overhead and one pod slot.
    """
    cpu = memory = gpus = 0
    for container in pod_spec.get("containers", ()):
        need = container_requests(container, gpu_resource)
        cpu, memory, gpus = cpu + need.cpu_milli, memory + need.memory, gpus + need.gpus
    total = Resources(cpu, memory, gpus, 1)
    inits = pod_spec.get("initContainers")
    if inits:
        sidecars = Resources()
        init_peak = Resources()
        for init in inits:
            need = container_requests(init, gpu_resource)
            if init.get("restartPolicy") == "Always":
                sidecars = sidecars + need
                init_peak = init_peak.max(sidecars)
            else:
                init_peak = init_peak.max(sidecars + need)
        total = (total + sidecars).max(init_peak)
    overhead = pod_spec.get("overhead")
    if overhead:
        total = total + from_resource_list(overhead, gpu_resource)
    return total
