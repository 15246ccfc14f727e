"""Observe from memory: the capacity ledger recomputes only changed nodes, counts created
but unbound ringwright pods on their planned nodes, and the cache overlays our own writes."""

from __future__ import annotations

from typing import Any

from ringwright.objects import Obj
from ringwright.operator.api.schedulingpolicy import NodeLabelKeys
from ringwright.operator.observe.cache import (
    JOB_CONFIGMAPS,
    NODES,
    POD_SLOTS,
    PODS_BY_JOB,
    POLICIES,
    PRIORITIES,
    IndexCache,
    Written,
    newer,
)
from ringwright.operator.observe.job import observe
from ringwright.operator.observe.ledger import (
    CapacityLedger,
    PodSlot,
    frees_room,
    node_record,
    pod_slots,
)
from ringwright.operator.plan.manifests import JOB_LABEL, PLANNED_NODE_ANNOTATION
from ringwright.operator.plan.placement.resources import Resources
from tests.jobs import training_job

GPU = "nvidia.com/gpu"
LABELS = NodeLabelKeys()


def node(name: str, gpus: int = 8, rack: str = "r1") -> Obj:
    return {"metadata": {"name": name, "labels": {LABELS.rack: rack}},
            "status": {"allocatable": {"cpu": "64", "memory": "512Gi", GPU: str(gpus)},
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def pod(uid: str, gpus: int, *, node_name: str = "", planned: str = "",
        phase: str = "Pending", priority: int = 0) -> Obj:
    annotations = {PLANNED_NODE_ANNOTATION: planned} if planned else {}
    return {"metadata": {"name": uid, "namespace": "a", "uid": uid,
                         "annotations": annotations},
            "spec": {"nodeName": node_name, "priority": priority, "containers": [
                {"name": "c", "resources": {"requests": {GPU: str(gpus)}}}]},
            "status": {"phase": phase}}


class Indices:
    """Dict-backed stand-ins for kopf's indices: key -> list of values."""

    def __init__(self, nodes: list[Obj], pods: list[Obj]) -> None:
        self.nodes: dict[str, list[Obj]] = {n["metadata"]["name"]: [node_record(n)]
                                             for n in nodes}
        self.slots: dict[str, list[PodSlot]] = {}
        for p in pods:
            self.add_pod(p)

    def add_pod(self, p: Obj) -> None:
        for name, slot in pod_slots(p).items():
            self.slots.setdefault(name, []).append(slot)

    def free_gpus(self, ledger: CapacityLedger) -> dict[str, int]:
        inv = ledger.inventory(self.nodes, self.slots, LABELS, GPU)
        return {n.name: n.free.gpus for n in inv.nodes}


def test_free_room_counts_bound_pods_and_unbound_ringwright_pods_on_their_planned_node(
) -> None:
    ix = Indices([node("n1"), node("n2")], [
        pod("bound", 2, node_name="n1", phase="Running"),
        pod("planned", 4, planned="n2"),
        pod("unplaced", 8),  # not ours, not bound: no node to count it on
        pod("done", 8, node_name="n1", phase="Succeeded"),
    ])
    assert ix.free_gpus(CapacityLedger()) == {"n1": 6, "n2": 4}


def test_room_is_given_back_by_a_placed_pod_that_goes_or_finishes_and_by_nothing_else(
) -> None:
    bound, planned = pod("a", 8, node_name="n1", phase="Running"), pod("b", 8, planned="n2")
    assert frees_room(bound, "DELETED") and frees_room(planned, "DELETED")
    assert frees_room(pod("c", 8, node_name="n1", phase="Succeeded"), "MODIFIED")
    assert frees_room(pod("d", 8, node_name="n1", phase="Failed"), None)
    # Created, bound or running: it takes room rather than gives it.
    assert not frees_room(bound, "MODIFIED") and not frees_room(planned, "ADDED")
    # Never on a node: it held no room to give back.
    assert not frees_room(pod("e", 8), "DELETED")


def test_only_nodes_marked_by_events_are_recomputed() -> None:
    ix = Indices([node(f"n{i}") for i in range(100)], [])
    ledger = CapacityLedger()
    ix.free_gpus(ledger)
    assert ledger.recomputed == 100
    ix.add_pod(pod("p", 8, node_name="n7", phase="Running"))
    assert ix.free_gpus(ledger)["n7"] == 8  # no event yet: the old answer stands
    ledger.mark({"n7"})
    assert ix.free_gpus(ledger)["n7"] == 0
    assert ledger.recomputed == 101


def test_a_planned_pod_counts_before_its_watch_event_and_once_after() -> None:
    ix = Indices([node("n1")], [])
    ledger = CapacityLedger()
    ix.free_gpus(ledger)
    created = pod("new", 8, planned="n1")
    ledger.reserve(created)
    assert ix.free_gpus(ledger)["n1"] == 0  # a second gang cannot plan into it
    ix.add_pod(created)  # the watch event arrives ...
    ledger.release(created)
    ledger.mark({"n1"})
    assert ix.free_gpus(ledger)["n1"] == 0  # ... and it is counted once, not twice


def test_a_refused_create_gives_its_reserved_room_back() -> None:
    ix = Indices([node("n1")], [])
    ledger = CapacityLedger()
    refused = pod("refused", 8, planned="n1")
    ledger.reserve(refused)
    assert ix.free_gpus(ledger)["n1"] == 0
    ledger.release(refused)
    assert ix.free_gpus(ledger)["n1"] == 8


def test_preemptible_room_is_bound_lower_priority_pods() -> None:
    ix = Indices([node("n1")], [pod("low", 2, node_name="n1", phase="Running", priority=10),
                                pod("high", 2, node_name="n1", phase="Running", priority=99)])
    inv = CapacityLedger().inventory(ix.nodes, ix.slots, LABELS, GPU, preemptible_below=50)
    assert (inv.nodes[0].free.gpus, inv.nodes[0].preemptible.gpus) == (4, 2)


def test_cordoned_and_deleted_nodes_leave_the_inventory() -> None:
    ix = Indices([node("n1"), node("n2")], [])
    ledger = CapacityLedger()
    ix.free_gpus(ledger)
    cordoned = node("n1")
    cordoned["spec"] = {"unschedulable": True}
    ix.nodes["n1"] = [node_record(cordoned)]
    del ix.nodes["n2"]
    ledger.mark({"n1", "n2"})
    assert ix.free_gpus(ledger) == {}


def _cache(ix: Indices, extra: dict[str, Any], written: Written) -> IndexCache:
    indices: dict[str, Any] = {NODES: ix.nodes, POD_SLOTS: ix.slots, **extra}
    return IndexCache(indices, CapacityLedger(), written)


def test_observe_reads_everything_from_the_indices_and_our_newer_writes() -> None:
    job = training_job("j")
    job["metadata"].update(namespace="a", uid="u1", generation=1)
    worker = pod("w0", 1, node_name="n1", phase="Running")
    worker["metadata"]["labels"] = {JOB_LABEL: "j"}
    worker["metadata"]["ownerReferences"] = [{"uid": "u1", "controller": True}]
    old_world = {"metadata": {"name": "j-world", "namespace": "a", "resourceVersion": "5"},
                 "data": {}}
    written = Written()
    ix = Indices([node("n1")], [worker])
    cache = _cache(ix, {
        PODS_BY_JOB: {("a", "j"): [worker]},
        JOB_CONFIGMAPS: {("a", "j-world"): [old_world]},
        POLICIES: {"default": [{}]},
        PRIORITIES: {},
    }, written)
    observed = observe(cache, job)
    assert [p["metadata"]["name"] for p in observed.pods] == ["w0"]
    assert observed.policy is not None and observed.world is None
    assert [n.name for n in observed.inventory.nodes] == ["n1"]
    # We wrote a newer world: the next round sees it before the watch delivers it.
    newer_world = {"metadata": {"name": "j-world", "namespace": "a", "resourceVersion": "9"},
                   "data": {"k": "v"}}
    written.put("ConfigMap", newer_world)
    assert cache.configmap("a", "j-world") == newer_world
    assert newer(newer_world, old_world) is newer_world
    written.forget_job("a", "j")
    assert cache.configmap("a", "j-world") == old_world


def test_a_missing_policy_observes_as_none() -> None:
    job = training_job("j", schedulingPolicyName="nope")
    job["metadata"].update(namespace="a")
    cache = _cache(Indices([], []), {PODS_BY_JOB: {}, JOB_CONFIGMAPS: {}, POLICIES: {},
                                     PRIORITIES: {}}, Written())
    assert observe(cache, job).policy is None


def test_an_event_regroups_only_the_rack_it_touched_and_keeps_the_others_answers() -> None:
    ix = Indices([node(f"a{i}", rack="ra") for i in range(4)]
                 + [node(f"b{i}", rack="rb") for i in range(4)], [])
    ledger = CapacityLedger()
    before = ledger.inventory(ix.nodes, ix.slots, LABELS, GPU)
    ix.add_pod(pod("p", 8, node_name="a1", phase="Running"))
    ledger.mark({"a1", "b2"})  # b2's room did not change
    after = ledger.inventory(ix.nodes, ix.slots, LABELS, GPU)
    assert after.groups[("", "rb")] is before.groups[("", "rb")]
    assert after.groups[("", "ra")] is not before.groups[("", "ra")]
    each = Resources(gpus=8, pods=1)
    assert after.groups[("", "ra")].room(each, ()).slots == 3
    assert before.groups[("", "ra")].room(each, ()).slots == 4  # a round holding it keeps it


def test_a_node_moving_racks_leaves_its_old_group() -> None:
    ix = Indices([node("n1", rack="ra"), node("n2", rack="ra")], [])
    ledger = CapacityLedger()
    ledger.inventory(ix.nodes, ix.slots, LABELS, GPU)
    ix.nodes["n1"] = [node_record(node("n1", rack="rb"))]
    ledger.mark({"n1"})
    inv = ledger.inventory(ix.nodes, ix.slots, LABELS, GPU)
    assert [n.name for n in inv.in_rack("ra")] == ["n2"]
    assert [n.name for n in inv.in_rack("rb")] == ["n1"]
    assert inv.racks() == ["ra", "rb"]
