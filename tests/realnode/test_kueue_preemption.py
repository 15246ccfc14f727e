"""Preempted by Kueue on real nodes: tests/e2e/test_kueue_preemption_job.py with the
job's workers in containers of the ``training`` image under the kubelet (containerd,
runc) instead of processes of the pod host. The preempted job writes its checkpoint on
the kubelet's SIGTERM, waits in the queue, and resumes from that checkpoint when Kueue
admits it again: every sample of every data epoch trained exactly once.

The test worker is staged on a hostPath (tests/realnode/staging.py), and so is the
checkpoint folder, which both real nodes see. The real nodes are plain nodes for this
module and the KWOK nodes cordoned (as in test_example_job.py); the ClusterQueue's GPU
quota is on the flavor of the real nodes' GPU model. The real Kueue and the operator
with the Kueue integration: tests/queueing.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ringwright.devcluster.demo import current_world
from ringwright.devcluster.realnode import RealNodeSet
from ringwright.devcluster.realnode_only import real_nodes_only as plain_real_nodes
from ringwright.kube import KubeClient, api_path
from ringwright.objects import Obj
from ringwright.operator.plan.kueue import PRIORITY_LABEL, QUEUE_LABEL
from tests.cluster.test_placement_cluster import cluster_facts, pods_of
from tests.jobs import OperatorProcess, get_status, tj_path
from tests.queueing import EvictionSeen, Queues, assert_resumed_once, checkpoint_after_eviction
from tests.realnode.conftest import SPECS
from tests.realnode.staging import MOUNT, hostpath_policy, run_staged_worker, stage_worker
from tests.runtime.elastic_traces import Traces
from tests.waiting import wait_for
from tests.xdist_groups import REALNODE_GROUP

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.xdist_group(REALNODE_GROUP),
              pytest.mark.timeout(1800)]

NODE_IMAGES = ("training",)
"""The image the nodes start with (tests/realnode/conftest.py)."""
SAMPLES, EPOCHS, BATCH = 512, 2, 4
HELD_AT = 20
"""The step the preempted job's workers wait at (a commit, between two checkpoint
intervals of 8) until their pods are being deleted, so the preemption finds the job
training whatever the machine's speed."""
GPUS = sum(s.gpus for s in SPECS)
"""The ClusterQueue's GPU quota: the real nodes' GPUs (advertised, no devices)."""


@pytest.fixture()
def real_queues(kube: KubeClient, namespace: str, queueing_operator: OperatorProcess,
                real_nodes: RealNodeSet) -> Iterator[Queues]:
    """The queues with the quota on the real nodes' model; KWOK nodes cordoned and the
    real nodes' taint removed meanwhile."""
    with plain_real_nodes(kube, real_nodes.names):
        handle = Queues(kube, namespace, gpus=GPUS)
        model = cluster_facts(kube)[real_nodes.names[0]].model
        assert handle.models[0] == model, (handle.models, model)
        try:
            yield handle
        finally:
            handle.cleanup()


def _queued(name: str, workers: int, gpus: int, queues: Queues, priority: str,
            policy: str, command: list[str]) -> Obj:
    return {
        "apiVersion": "ringwright.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": name, "labels": {QUEUE_LABEL: queues.local_queue,
                                              PRIORITY_LABEL: queues.priorities[priority]}},
        "spec": {
            "gpusPerWorker": gpus, "schedulingPolicyName": policy,
            "workers": {"min": workers, "replicas": workers, "max": workers,
                        "numProcPerNode": 1, "template": {"spec": {"containers": [
                            {"name": "train", "image": "", "command": command}]}}},
        },
    }


def test_a_job_preempted_on_real_nodes_checkpoints_requeues_and_resumes_with_every_sample_once(
    kube: KubeClient, namespace: str, real_nodes: RealNodeSet, training_image: str,
    real_queues: Queues, tmp_path: Path, request: pytest.FixtureRequest,
) -> None:
    ns, folder = namespace, tmp_path / "bench"
    traces = stage_worker(folder)
    checkpoints, gate = folder / "ckpt", folder / "held"
    checkpoints.mkdir()
    checkpoints.chmod(0o777)  # the image runs as uid 10001; a hostPath gets no fsGroup
    policy = hostpath_policy(kube, ns, folder)
    request.addfinalizer(lambda: kube.delete(
        api_path("ringwright.dev/v1alpha1", "schedulingpolicies", name=policy)))

    # 2 workers of 2 GPUs at priority 100, of the nodes' 8-GPU quota.
    low = _queued("low", 2, 2, real_queues, "low", policy, [])
    run_staged_worker(low["spec"]["workers"]["template"]["spec"], training_image, folder,
                      {"EPOCHS": str(EPOCHS), "SAMPLES": str(SAMPLES), "BATCH": str(BATCH),
                       "COMMIT_EVERY": "4", "STEP_SLEEP": "0.05", "OMP_NUM_THREADS": "1",
                       "GATE_FILE": f"{MOUNT}/held", "GATE_STEP": str(HELD_AT)})
    low["spec"]["checkpoint"] = {"path": f"{MOUNT}/ckpt", "intervalSteps": 8}
    gate.touch()
    kube.create(tj_path(ns), low)
    evicted = EvictionSeen(kube, ns, "low")
    try:
        wait_for(lambda: Traces.load(traces).max_step() >= HELD_AT,
                 f"low: training to step {HELD_AT} in its containers", timeout=900)
        first = current_world(kube, ns, "low")
        assert first is not None and first.size == 2, first
        assert {p["spec"]["nodeName"] for p in pods_of(kube, ns, "low")} <= set(real_nodes.names)

        # 2 workers of 4 GPUs at priority 1000 do not fit beside low's 4: Kueue preempts
        # low. Their containers only wait (a shell that ends on SIGTERM).
        high = _queued("high", 2, 4, real_queues, "high", policy,
                       ["sh", "-c", "trap 'exit 0' TERM; sleep 100000 & wait"])
        high["spec"]["workers"]["template"]["spec"]["containers"][0]["image"] = training_image
        kube.create(tj_path(ns), high)
        wait_for(lambda: evicted.at, "low: its Workload evicted", timeout=300)
        wait_for(lambda: all(p["metadata"].get("deletionTimestamp")
                             for p in pods_of(kube, ns, "low")), "low: its pods deleted",
                 timeout=300)
        gate.unlink()
        wait_for(lambda: get_status(kube, ns, "low").get("phase") == "Suspended"
                 and not pods_of(kube, ns, "low"), "low: Suspended, its pods gone", timeout=300)
        stopped = checkpoint_after_eviction(Traces.load(traces), first.generation,
                                            checkpoints, HELD_AT, evicted, "real nodes; ")

        # high goes: low is admitted again and resumes from that checkpoint.
        kube.delete(tj_path(ns, "high"))
        wait_for(lambda: get_status(kube, ns, "low").get("phase") == "Succeeded",
                 "low: readmitted and trained to the end", timeout=900, interval=2)
        history = assert_resumed_once(kube, ns, "low", Traces.load(traces), first.generation,
                                      stopped, SAMPLES, EPOCHS)
        # Between the resumed Running and Succeeded, real nodes have shown a moment of
        # Restarting (BelowMinimum) at the end of training (docs/kueue.md).
        print("low's phases:", [(p["phase"], p.get("reason")) for p in history])
        phases = [p["phase"] for p in history]
        after = phases[phases.index("Suspended"):]
        assert after[:3] == ["Suspended", "Pending", "Running"] and after[-1] == "Succeeded", \
            phases
    finally:
        evicted.close()
