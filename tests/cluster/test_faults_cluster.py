"""The operator's lifecycle under faults, on the real control plane: lost or corrupted
worlds, operator restarts, lost nodes, control-plane restarts."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from ringwright.devcluster.control_plane import NODE_DOWN_ANNOTATION, Cluster
from ringwright.kube import ApiError, KubeClient, api_path
from ringwright.operator.apibase import API_VERSION
from ringwright.operator.apply import Applier
from ringwright.operator.cache import Written
from ringwright.operator.epochs import EPOCH_ANNOTATION
from ringwright.operator.events import EventRecorder
from ringwright.operator.ledger import CapacityLedger
from ringwright.operator.nodeloss import NOT_READY_TAINT, UNREACHABLE_TAINT
from ringwright.operator.reconcile import Plan
from ringwright.operator.schedulingpolicy import NodeLoss, SchedulingPolicy, SchedulingPolicySpec
from ringwright.runtime.kube_source import KubeMembershipSource
from ringwright.world import ContractError, World, parse_world, world_configmap_name
from tests.cluster.test_operator import events_of, wait_world, world_of
from tests.jobs import OperatorProcess, get_status, tj_path, training_job
from tests.waiting import wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture()
def follower(cluster: Cluster) -> Iterator[Any]:
    """Makes runtime membership sources (the pods' own watch code) and closes them."""
    sources: list[KubeMembershipSource] = []

    def make(namespace: str, job: str) -> KubeMembershipSource:
        source = KubeMembershipSource(cluster.client, namespace, world_configmap_name(job))
        sources.append(source)
        return source

    yield make
    for source in sources:
        source.close()


def _world_path(namespace: str, job: str) -> str:
    return api_path("v1", "configmaps", namespace, world_configmap_name(job))


def readable_world(kube: KubeClient, namespace: str, job: str) -> World | None:
    """The job's world, or None while it is missing or unreadable."""
    cm = kube.get_or_none(_world_path(namespace, job))
    try:
        return parse_world(((cm or {}).get("data") or {}).get("world.json") or "")
    except ContractError:
        return None


def wait_readable_world(kube: KubeClient, namespace: str, job: str, size: int, after: int,
                        timeout: float = 30) -> World:
    """A readable world of ``size`` members above epoch ``after``."""
    def probe() -> World | None:
        world = readable_world(kube, namespace, job)
        return world if world is not None and world.size == size and world.epoch > after \
            else None

    return wait_for(probe, f"a readable world of size {size} after epoch {after}",
                    timeout=timeout)


def test_epochs_only_go_up_across_a_deleted_or_corrupted_world_and_operator_restarts(
    kube: KubeClient, namespace: str, operator: OperatorProcess, follower: Any,
) -> None:
    kube.create(tj_path(namespace), training_job("epochs", replicas=2, minimum=1))
    first = wait_world(kube, namespace, "epochs", 2)
    runtime = follower(namespace, "epochs")
    wait_for(lambda: (w := runtime.latest()) is not None and w.epoch >= first.epoch,
             "the runtime to follow the first world")
    epochs = [first.epoch]

    def next_world(what: str) -> None:
        world = wait_readable_world(kube, namespace, "epochs", 2, after=epochs[-1])
        epochs.append(world.epoch)
        # The pods' watch code takes it: the new epoch is above the one it follows.
        wait_for(lambda: (w := runtime.latest()) is not None and w.epoch == world.epoch,
                 f"the runtime to follow epoch {world.epoch} after {what}", timeout=30)
        status = wait_for(lambda: (s := get_status(kube, namespace, "epochs"))
                          .get("world", {}).get("epoch") == world.epoch and s,
                          f"status to mirror epoch {world.epoch}")
        assert status["phase"] == "Running"

    try:
        kube.delete(_world_path(namespace, "epochs"))
        next_world("the world ConfigMap was deleted")

        kube.merge_patch(_world_path(namespace, "epochs"),
                         {"data": {"world.json": "{not a world"}})
        next_world("the world document was corrupted")

        # Corrupted document and annotation, while the operator is down: the status still
        # remembers the epoch.
        operator.kill()
        kube.merge_patch(_world_path(namespace, "epochs"), {
            "metadata": {"annotations": {EPOCH_ANNOTATION: "garbage"}},
            "data": {"world.json": "[]"}})
        operator.start()
        next_world("a corrupted world met a restarted operator")

        operator.kill()
        kube.delete(_world_path(namespace, "epochs"))
        operator.start()
        next_world("the world was deleted while the operator was down")

        # Another writer published far ahead: the operator's next world goes above it.
        kube.merge_patch(_world_path(namespace, "epochs"), {
            "metadata": {"annotations": {EPOCH_ANNOTATION: str(epochs[-1] + 50)}},
            "data": {"world.json": "{}"}})
        next_world("another writer went ahead")
        assert epochs[-1] > epochs[-2] + 50
    except AssertionError as err:
        raise AssertionError(f"{err}\nepochs {epochs}\noperator log:\n{operator.tail(40)}"
                             ) from err
    assert epochs == sorted(set(epochs)), epochs


def test_a_world_write_over_a_stale_version_is_refused(
    kube: KubeClient, namespace: str, operator: OperatorProcess,
) -> None:
    """The operator's world write, against the real API server: a plan decided from an
    older version of the world gets 409 and changes nothing."""
    kube.create(tj_path(namespace), training_job("fenced", replicas=1, minimum=1))
    world = wait_world(kube, namespace, "fenced", 1)
    job = kube.get(tj_path(namespace, "fenced"))
    current = kube.get(_world_path(namespace, "fenced"))
    other = world.model_copy(update={"epoch": world.epoch + 1, "members": ()})
    with ThreadPoolExecutor(2) as pool:
        applier = Applier(kube, time.time, pool=pool, events=EventRecorder(kube, time.time),
                          ledger=CapacityLedger(), written=Written())
        stale = str(int(current["metadata"]["resourceVersion"]) - 1)
        for version in (stale, ""):  # an older version; "none exists" when one does
            with pytest.raises(ApiError) as refused:
                applier.perform(job, Plan(world=other, world_version=version))
            assert refused.value.status == 409
    after = world_of(kube, namespace, "fenced")
    assert after is not None and after.epoch == world.epoch and after.size == 1


@pytest.fixture()
def fast_node_loss(kube: KubeClient, namespace: str) -> Iterator[str]:
    """A SchedulingPolicy of this test's own that gives up on lost nodes in seconds."""
    name = f"{namespace}-node-loss"
    policy = SchedulingPolicy(metadata={"name": name}, spec=SchedulingPolicySpec(
        node_loss=NodeLoss(toleration_seconds=10, unready_seconds=4)))
    kube.create(api_path(API_VERSION, "schedulingpolicies"), policy.to_wire())
    yield name
    kube.delete(api_path(API_VERSION, "schedulingpolicies", name=name))


def _set_node_down(kube: KubeClient, node: str, down: bool) -> None:
    kube.merge_patch(api_path("v1", "nodes", name=node),
                     {"metadata": {"annotations": {NODE_DOWN_ANNOTATION: "true" if down
                                                   else None}}})


def test_a_member_on_a_lost_node_is_replaced_on_another_node(
    kube: KubeClient, namespace: str, operator: OperatorProcess, fast_node_loss: str,
) -> None:
    kube.create(tj_path(namespace), training_job("nodeloss", replicas=3, minimum=2,
                                                 schedulingPolicyName=fast_node_loss))
    before = wait_world(kube, namespace, "nodeloss", 3)
    victim = before.members[1]
    pod = kube.get(api_path("v1", "pods", namespace, victim.pod))
    tolerations = {t["key"]: t.get("tolerationSeconds") for t in pod["spec"]["tolerations"]
                   if t.get("effect") == "NoExecute"}
    assert tolerations == {NOT_READY_TAINT: 10, UNREACHABLE_TAINT: 10}

    _set_node_down(kube, victim.node, True)
    try:
        # KWOK reports the node NotReady; the node lifecycle controller taints it.
        wait_for(lambda: any(t["key"] == NOT_READY_TAINT for t in kube.get(
            api_path("v1", "nodes", name=victim.node))["spec"].get("taints") or ()),
            "the node lifecycle controller to taint the lost node", timeout=30)
        healed = wait_world(kube, namespace, "nodeloss", 3, after=before.epoch, timeout=60)
        replacement = next(m for m in healed.members if m.pod == victim.pod)
        assert replacement.pod_uid != victim.pod_uid and replacement.node != victim.node
        status = wait_for(lambda: (s := get_status(kube, namespace, "nodeloss"))
                          .get("phase") == "Running" and s, "the job to be Running again")
        # Every pod on the lost node counts once.
        assert status["restarts"] == sum(1 for m in before.members if m.node == victim.node)
        assert "NodeNotReady" in events_of(kube, namespace, "nodeloss")
    except AssertionError as err:
        raise AssertionError(f"{err}\noperator log:\n{operator.tail(40)}") from err
    finally:
        _set_node_down(kube, victim.node, False)
