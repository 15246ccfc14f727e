"""The pod template's own node constraints, through the real kube-scheduler.

A nodeSelector and required node affinity narrow the nodes the operator plans onto; a
job they make impossible is refused with the constraint named and counted, and never
gets pods the scheduler cannot bind (which the gang timeout would withdraw, again and
again). The labels are put on the session's KWOK nodes by the test and taken off after.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from ringwright.kube import KubeClient, api_path
from ringwright.operator.api.schedulingpolicy import GPU_MODEL_LABEL
from tests.cluster.test_placement_cluster import (
    SLOW,
    all_pods_of,
    cluster_facts,
    condition,
    job,
    pods_of,
    wait_quiet,
    wait_running,
    wait_unschedulable,
)
from tests.jobs import OperatorProcess, reconciled, tj_path
from tests.waiting import wait_for

pytestmark = pytest.mark.cluster

NODES = api_path("v1", "nodes")


@pytest.fixture()
def pool(kube: KubeClient) -> Iterator[tuple[str, list[str]]]:
    """A label key put on three nodes of one GPU model with the most free GPUs (value
    ``a`` on two, ``b`` on one), removed after the test. The last such nodes by name: the
    planner, left to itself, would start from the first rack."""
    key = f"test.ringwright.dev/pool-{uuid.uuid4().hex[:6]}"
    facts = cluster_facts(kube)
    model = sorted({n.model for n in facts.values() if n.model})[0]
    roomiest = sorted((n for n in facts.values() if n.model == model),
                      key=lambda n: (n.free_gpus, n.name), reverse=True)[:3]
    names = [n.name for n in roomiest]
    for name, value in zip(names, ("a", "a", "b"), strict=True):
        kube.merge_patch(api_path("v1", "nodes", name=name),
                         {"metadata": {"labels": {key: value}}})
    yield key, names
    for name in names:
        kube.merge_patch(api_path("v1", "nodes", name=name),
                         {"metadata": {"labels": {key: None}}})


def test_node_selector_and_affinity_keep_workers_on_the_allowed_nodes(
    kube: KubeClient, namespace: str, operator: OperatorProcess,
    pool: tuple[str, list[str]],
) -> None:
    wait_quiet(kube, namespace)
    key, (first, second, third) = pool
    facts = cluster_facts(kube)
    # nodeSelector allows first and second (value a); the affinity then rules out second
    # by name, and the Exists/NotIn expressions are evaluated on labels too.
    gpus = 2
    size = facts[first].free_gpus // gpus
    manifest = job("picky-nodes", size, gpus)
    manifest["spec"]["workers"]["template"]["spec"].update({
        "nodeSelector": {key: "a"},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{
                "matchExpressions": [{"key": key, "operator": "Exists"},
                                     {"key": key, "operator": "NotIn", "values": ["b"]}],
                "matchFields": [{"key": "metadata.name", "operator": "NotIn",
                                 "values": [second]}],
            }]}}},
    })
    kube.create(tj_path(namespace), manifest)
    wait_running(kube, namespace, "picky-nodes", size)
    nodes = {p["spec"]["nodeName"] for p in pods_of(kube, namespace, "picky-nodes")}
    assert nodes == {first}, f"workers on {nodes}; only {first} is allowed ({third} has b)"


def test_a_selector_no_node_matches_is_refused_naming_it_without_pods(
    kube: KubeClient, namespace: str, operator: OperatorProcess,
    pool: tuple[str, list[str]],
) -> None:
    key, names = pool
    model = cluster_facts(kube)[names[0]].model
    manifest = job("nowhere", 2, 1)
    # Both values exist on some node, never on a node of the other model: together they
    # leave nothing, which the message says along with each one's count.
    manifest["spec"]["workers"]["template"]["spec"]["nodeSelector"] = {
        key: "a", GPU_MODEL_LABEL: next(m for m in sorted(
            {n.model for n in cluster_facts(kube).values() if n.model}) if m != model)}
    kube.create(tj_path(namespace), manifest)
    cond = wait_unschedulable(kube, namespace, "nowhere")
    assert cond["reason"] == "NodeConstraintsUnsatisfiable", cond
    assert f"nodeSelector {key}=a: 2" in cond["message"], cond["message"]
    assert "together leave 0 of" in cond["message"], cond["message"]

    def refused_event() -> bool:
        return any(e.get("reason") == "NodeConstraintsUnsatisfiable"
                   for e in kube.list(api_path("v1", "events", namespace)))

    wait_for(refused_event, "a NodeConstraintsUnsatisfiable event", timeout=SLOW)
    # Rounds go on; none creates a pod, so there is nothing for the gang timeout to withdraw.
    for _ in range(2):
        status = reconciled(kube, namespace, "nowhere", timeout=SLOW)
        assert status["phase"] == "Pending"
        assert all_pods_of(kube, namespace, "nowhere") == []
    assert not [e for e in kube.list(api_path("v1", "events", namespace))
                if e.get("reason") == "GangTimeout"]

    # Labelling a node of the other model "a" makes it placeable: the refusal was honest.
    other = next(n for n in cluster_facts(kube).values()
                 if n.model and n.model != model and n.free_gpus >= 2)
    kube.merge_patch(api_path("v1", "nodes", name=other.name),
                     {"metadata": {"labels": {key: "a"}}})
    try:
        wait_running(kube, namespace, "nowhere", 2)
        assert {p["spec"]["nodeName"] for p in pods_of(kube, namespace, "nowhere")} == {
            other.name}
        placed = condition(kube, namespace, "nowhere", "Schedulable")
        assert placed is not None and placed["status"] == "True"
    finally:
        kube.merge_patch(api_path("v1", "nodes", name=other.name),
                         {"metadata": {"labels": {key: None}}})
