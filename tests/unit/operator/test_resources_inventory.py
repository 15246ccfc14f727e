"""Quantities, pod requests, the node inventory and the resources each role gets."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from ringwright.operator.api.schedulingpolicy import NodeLabelKeys, PSPinning
from ringwright.operator.plan.placement.inventory import (
    GroupRoom,
    NodeGroup,
    NodeInfo,
    Taint,
    admits,
    inventory_from_objects,
)
from ringwright.operator.plan.placement.podresources import (
    ps_container_resources,
    ps_pod_spec,
    worker_container_resources,
    worker_pod_spec,
)
from ringwright.operator.plan.placement.resources import Resources, parse_quantity, pod_requests

GPU = "nvidia.com/gpu"
GI = 1024**3


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1", Decimal(1)),
        ("500m", Decimal("0.5")),
        ("2.5", Decimal("2.5")),
        ("8Gi", Decimal(8 * GI)),
        ("1k", Decimal(1000)),
        ("1e3", Decimal(1000)),
        ("100M", Decimal(100_000_000)),
        (".5", Decimal("0.5")),
        (4, Decimal(4)),
    ],
)
def test_parse_quantity(text: str | int, value: Decimal) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "lots", "1Gb", "--1", "1 Gi"])
def test_parse_quantity_refuses_garbage(text: str) -> None:
    with pytest.raises(ValueError, match="quantity"):
        parse_quantity(text)


def _container(requests: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    return {"name": "c", "image": "x", "resources": {"requests": requests or {}}, **extra}


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"containers": [_container({"cpu": "1", "memory": "1Gi"})]},
         Resources(1000, GI, 0, 1)),
        ({"containers": [_container({"cpu": "1"}), _container({"cpu": "500m", GPU: "2"})]},
         Resources(1500, 0, 2, 1)),
        # A limit alone is also the request.
        ({"containers": [{"name": "c", "resources": {"limits": {"cpu": "2", GPU: "1"}}}]},
         Resources(2000, 0, 1, 1)),
        # A big init container raises the peak; it does not add to the containers.
        ({"initContainers": [_container({"cpu": "4"})], "containers": [_container({"cpu": "1"})]},
         Resources(4000, 0, 0, 1)),
        # A sidecar (restartPolicy Always) runs alongside the containers.
        ({"initContainers": [_container({"cpu": "1"}, restartPolicy="Always")],
          "containers": [_container({"cpu": "1"})]},
         Resources(2000, 0, 0, 1)),
        ({"containers": [_container({"cpu": "1"})], "overhead": {"cpu": "250m"}},
         Resources(1250, 0, 0, 1)),
    ],
    ids=["one", "two-add-up", "limit-only", "init-peak", "sidecar", "overhead"],
)
def test_pod_requests(spec: dict[str, Any], expected: Resources) -> None:
    assert pod_requests(spec, GPU) == expected


def test_count_fitting_is_the_scarcest_resource() -> None:
    free = Resources(cpu_milli=10_000, memory=64 * GI, gpus=8, pods=3)
    assert free.count_fitting(Resources(1000, GI, 2, 1)) == 3  # pods
    assert free.count_fitting(Resources(4000, GI, 1, 1)) == 2  # cpu
    assert free.count_fitting(Resources(0, 0, 3, 1)) == 2  # gpus
    assert Resources(-1000, 0, 0, 5).count_fitting(Resources(1000, 0, 0, 1)) == 0


def _node(name: str, **labels: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": labels},
        "status": {
            "allocatable": {"cpu": "64", "memory": "512Gi", GPU: "8", "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def _pod(node: str, cpu: str, gpus: str = "0", phase: str = "Running", priority: int = 0
         ) -> dict[str, Any]:
    return {
        "spec": {
            "nodeName": node,
            "priority": priority,
            "containers": [_container({"cpu": cpu, GPU: gpus})],
        },
        "status": {"phase": phase},
    }


def test_inventory_reads_labels_and_subtracts_running_pods() -> None:
    nodes = [
        _node("n1", **{"ringwright.dev/rack": "r1", "nvidia.com/gpu.clique": "d1",
                       "nvidia.com/gpu.product": "H100", "example.com/spine": "s1"}),
        _node("n0"),
    ]
    pods = [
        _pod("n1", "4", "2"),
        _pod("n1", "8", "4", phase="Succeeded"),  # finished: holds nothing
        {"spec": {"containers": [_container({"cpu": "1"})]}, "status": {"phase": "Pending"}},
        _pod("n1", "2", priority=-10),
    ]
    labels = NodeLabelKeys(spine="example.com/spine")
    inv = inventory_from_objects(nodes, pods, labels, GPU, preemptible_below=1000)
    assert [n.name for n in inv.nodes] == ["n0", "n1"]
    n1 = inv.node("n1")
    assert n1 is not None
    assert (n1.rack, n1.nvlink_domain, n1.gpu_model, n1.spine) == ("r1", "d1", "H100", "s1")
    assert n1.free == Resources(58_000, 512 * GI, 6, 108)
    # Both live pods are below the ps priority: both may be preempted.
    assert n1.preemptible == Resources(6000, 0, 2, 2)
    assert inv.node("n0") == NodeInfo("n0", free=Resources(64_000, 512 * GI, 8, 110))


def test_inventory_leaves_out_cordoned_and_not_ready_nodes() -> None:
    cordoned = {**_node("a"), "spec": {"unschedulable": True}}
    down = _node("b")
    down["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    fresh = {"metadata": {"name": "c"}, "status": {"allocatable": {"cpu": "4"}}}
    inv = inventory_from_objects([cordoned, down, fresh], [], NodeLabelKeys(), GPU)
    assert [n.name for n in inv.nodes] == ["c"]
    # No pods entry in allocatable: the kubelet default.
    assert inv.nodes[0].free.pods == 110


@pytest.mark.parametrize(
    ("tolerations", "taint", "ok"),
    [
        ([], Taint("gpu", "true", "NoSchedule"), False),
        ([], Taint("gpu", "true", "PreferNoSchedule"), True),
        ([{"key": "gpu", "operator": "Equal", "value": "true"}], Taint("gpu", "true"), True),
        ([{"key": "gpu", "value": "false"}], Taint("gpu", "true"), False),
        ([{"key": "gpu", "operator": "Exists"}], Taint("gpu", "x", "NoExecute"), True),
        ([{"operator": "Exists"}], Taint("anything", "x"), True),
        ([{"key": "gpu", "operator": "Exists", "effect": "NoExecute"}], Taint("gpu"), False),
    ],
)
def test_taints_and_tolerations(tolerations: list[dict[str, str]], taint: Taint, ok: bool) -> None:
    assert admits(NodeInfo("n", taints=(taint,)), tolerations) is ok


def test_worker_resources_carry_exactly_the_jobs_gpus() -> None:
    template = {"requests": {"cpu": "4", GPU: "1"}, "limits": {GPU: "1", "memory": "8Gi"}}
    assert worker_container_resources(template, 4, GPU) == {
        "requests": {"cpu": "4", GPU: "4"},
        "limits": {"memory": "8Gi", GPU: "4"},
    }
    assert worker_container_resources(template, 0, GPU) == {
        "requests": {"cpu": "4"}, "limits": {"memory": "8Gi"},
    }
    assert worker_container_resources(None, 0, GPU) == {}
    spec = worker_pod_spec({"containers": [{"name": "t"}, {"name": "side"}]}, 2, GPU)
    assert spec["containers"][0]["resources"] == {"requests": {GPU: "2"}, "limits": {GPU: "2"}}
    assert "resources" not in spec["containers"][1]


@pytest.mark.parametrize(
    ("resources", "expected"),
    [
        (None, {"cpu": "4", "memory": "8Gi"}),
        ({"requests": {"cpu": "1500m", "memory": "2Gi"}}, {"cpu": "2", "memory": "2Gi"}),
        ({"requests": {"cpu": "1"}, "limits": {"cpu": "3"}}, {"cpu": "3", "memory": "8Gi"}),
        ({"requests": {"cpu": "100m"}}, {"cpu": "1", "memory": "8Gi"}),
    ],
)
def test_ps_resources_are_guaranteed_whole_cpus(
    resources: dict[str, Any] | None, expected: dict[str, str]
) -> None:
    out = ps_container_resources(resources, PSPinning())
    assert out == {"requests": expected, "limits": expected}


def test_ps_pinning_off_keeps_the_template() -> None:
    res = {"requests": {"cpu": "500m"}}
    assert ps_container_resources(res, PSPinning(enabled=False)) == res


def test_ps_pod_spec_makes_every_container_guaranteed() -> None:
    spec = ps_pod_spec(
        {"initContainers": [{"name": "i"}], "containers": [{"name": "a"}, {"name": "b"}]},
        PSPinning(default_cpus=2, default_memory="1Gi"),
    )
    for c in spec["initContainers"] + spec["containers"]:
        assert c["resources"]["requests"] == c["resources"]["limits"] == {
            "cpu": "2", "memory": "1Gi"}


def test_a_group_remembers_room_per_pod_shape_and_tolerations() -> None:
    tainted = NodeInfo("t", rack="r", free=Resources(gpus=8, pods=10),
                       taints=(Taint("dedicated", "ps", "NoSchedule"),))
    plain = NodeInfo("p", rack="r", free=Resources(gpus=8, pods=10))
    group = NodeGroup([tainted, plain])
    eight, two = Resources(gpus=8, pods=1), Resources(gpus=2, pods=1)
    assert group.room(eight, ()).slots == 1
    assert group.room(two, ()) == GroupRoom(1, ((plain, 4),), 4)
    tolerating = ({"key": "dedicated", "operator": "Exists"},)
    assert group.room(two, tolerating).slots == 8
    assert group.room(two, ()) is group.room(two, ())
