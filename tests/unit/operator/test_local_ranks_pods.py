"""The worker pod template for several ranks per pod and NCCL within a node."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from ringwright.objects import Obj
from ringwright.operator.plan.manifests import LAUNCH_COMMAND, pod, procs_per_pod
from ringwright.world import Env


def job(gpus: int = 8, nproc: Any = None, mode: str = "AllReduce",
        container: Obj | None = None) -> Obj:
    workers: Obj = {"replicas": 2, "template": {"spec": {"containers": [
        container or {"name": "train", "image": "img", "command": ["python", "train.py"],
                      "args": ["--epochs", "3"]}]}}}
    if nproc is not None:
        workers["numProcPerNode"] = nproc
    return {"apiVersion": "ringwright.dev/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": "tj", "namespace": "ns", "uid": "uid-tj"},
            "spec": {"mode": mode, "gpusPerWorker": gpus, "workers": workers}}


def env_of(built: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in built["spec"]["containers"][0]["env"]}


@pytest.mark.parametrize(("gpus", "nproc", "mode", "expected"), [
    (8, None, "AllReduce", 8),          # auto: one per GPU
    (8, "auto", "AllReduce", 8),
    (1, "auto", "AllReduce", 1),
    (0, "auto", "AllReduce", 1),        # CPU: one process unless asked
    (0, 3, "AllReduce", 3),
    (8, 1, "AllReduce", 1),             # one process that sees every GPU, as before
    (8, "auto", "ParameterServer", 8),  # PS workers: one per GPU too
    (0, 2, "ParameterServer", 2),
])
def test_num_proc_per_node_resolves(gpus: int, nproc: Any, mode: str, expected: int) -> None:
    built = job(gpus, nproc, mode)
    assert procs_per_pod(built) == expected
    assert env_of(pod(built, "worker", 0, {}))[Env.PROCS_PER_POD]["value"] == str(expected)


def test_several_ranks_wrap_the_command_in_the_pod_entry_point() -> None:
    main = pod(job(8), "worker", 0, {})["spec"]["containers"][0]
    assert main["command"] == list(LAUNCH_COMMAND)
    assert main["args"] == ["python", "train.py", "--epochs", "3"]


def test_one_rank_keeps_the_command_as_written() -> None:
    main = pod(job(8, 1), "worker", 0, {})["spec"]["containers"][0]
    assert (main["command"], main["args"]) == (["python", "train.py"], ["--epochs", "3"])


def test_without_a_command_there_is_nothing_to_wrap() -> None:
    main = pod(job(8, container={"name": "train", "image": "img"}), "worker", 0, {})
    assert "command" not in main["spec"]["containers"][0]


def test_nccl_takes_the_node_name_for_its_host_id() -> None:
    for role in ("worker", "ps"):
        built = job(8)
        built["spec"]["ps"] = {"template": copy.deepcopy(built["spec"]["workers"]["template"])}
        env = env_of(pod(built, role, 0, {}))
        assert env["NCCL_HOSTID"] == {"name": "NCCL_HOSTID",
                                      "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}


def test_dev_shm_is_memory_backed_and_mounted_once() -> None:
    built = pod(job(8), "worker", 0, {})
    spec = built["spec"]
    shm = [v for v in spec["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    assert len(shm) == 1
    mounts = spec["containers"][0]["volumeMounts"]
    assert [m for m in mounts if m["mountPath"] == "/dev/shm"] == [
        {"name": shm[0]["name"], "mountPath": "/dev/shm"}]
    # A pod spec built again from its own output keeps one volume and one mount.
    again = job(8)
    again["spec"]["workers"]["template"]["spec"] = copy.deepcopy(spec)
    rebuilt = pod(again, "worker", 0, {})["spec"]
    assert len(rebuilt["volumes"]) == 1 and len(rebuilt["containers"][0]["volumeMounts"]) == 1


def test_a_template_with_its_own_dev_shm_keeps_it() -> None:
    own = {"name": "train", "image": "img", "command": ["python", "t.py"],
           "volumeMounts": [{"name": "big-shm", "mountPath": "/dev/shm"}]}
    built = job(8, container=own)
    built["spec"]["workers"]["template"]["spec"]["volumes"] = [
        {"name": "big-shm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}}]
    spec = pod(built, "worker", 0, {})["spec"]
    assert spec["volumes"] == [{"name": "big-shm",
                                "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}}]
    assert spec["containers"][0]["volumeMounts"] == own["volumeMounts"]


def test_the_world_lists_each_pods_local_ranks_in_ring_order() -> None:
    from ringwright.operator.plan.placement.inventory import NodeInfo
    from ringwright.operator.plan.pods import PodState, PodView
    from ringwright.operator.plan.worldplan import build_world
    from ringwright.world import CheckpointSettings, JobRef, LRScaling, parse_world

    nodes = {n: NodeInfo(n, rack=r, nvlink_domain=d)
             for n, r, d in [("n1", "r2", "d1"), ("n2", "r1", "d2"), ("n3", "r1", "d1")]}

    def view(index: int, node: str) -> PodView:
        return PodView(name=f"tj-worker-{index}", uid=f"u{index}", role="worker", index=index,
                       state=PodState.READY, ip=f"10.0.0.{index + 1}", node=node,
                       leaving_since=None, restarts=0)

    pods = [view(0, "n1"), view(1, "n2"), view(2, "n3"), view(3, "n3")]
    world = build_world(JobRef(namespace="ns", name="tj"), 1, pods, None, nodes,
                        backend="torch", mode="AllReduce", store_port=29400,
                        lr=LRScaling(), checkpoint=CheckpointSettings(), local_ranks=3)
    # (rack, NVLink domain, node, pod, local rank): r1/d1/n3 (pods 2, 3), r1/d2, r2.
    assert [(m.rank, m.pod[-1], m.local_rank) for m in world.members] == [
        (0, "2", 0), (1, "2", 1), (2, "2", 2), (3, "3", 0), (4, "3", 1), (5, "3", 2),
        (6, "1", 0), (7, "1", 1), (8, "1", 2), (9, "0", 0), (10, "0", 1), (11, "0", 2)]
    assert world.store.address == "10.0.0.3"
    assert parse_world(world.to_json()) == world
    # Survivors keep their relative order; a pod's ranks stay together.
    later = build_world(JobRef(namespace="ns", name="tj"), 2, [pods[0], pods[3], pods[2]],
                        world, nodes, backend="torch", mode="AllReduce", store_port=29400,
                        lr=LRScaling(), checkpoint=CheckpointSettings(), local_ranks=3)
    assert later.pods == ("tj-worker-2", "tj-worker-3", "tj-worker-0")


def test_a_world_of_several_ranks_per_pod_is_the_membership_of_its_pods() -> None:
    # Otherwise every round would take the published world for a changed membership.
    from ringwright.operator.plan.pods import PodState, PodView
    from ringwright.operator.plan.worldplan import build_world, membership_digest, world_digest
    from ringwright.world import CheckpointSettings, JobRef, LRScaling

    pods = [PodView(name=f"tj-worker-{i}", uid=f"u{i}", role="worker", index=i,
                    state=PodState.READY, ip=f"10.0.0.{i + 1}", node="n", leaving_since=None,
                    restarts=0) for i in range(2)]
    world = build_world(JobRef(namespace="ns", name="tj"), 1, pods, None, {},
                        backend="torch", mode="AllReduce", store_port=29400,
                        lr=LRScaling(), checkpoint=CheckpointSettings(), local_ranks=3)
    assert world_digest(world) == membership_digest(pods)
