"""Preempted by Kueue without losing work: a training job whose quota a higher-priority
job takes writes its checkpoint on the SIGTERM its pods get, waits in the queue, and
resumes from that checkpoint when Kueue admits it again: every sample of every data
epoch trained exactly once across the two admissions.

The pod host runs the preempted job's pods and stops them as a kubelet does (SIGTERM,
then the pod's grace period); the other job's pods run nothing (KWOK). The real Kueue
and the queues: tests/queueing.py.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from ringwright.devcluster.podhost import PodHost
from ringwright.kube import KubeClient, api_path
from tests.cluster.test_placement_cluster import SLOW, pods_of, wait_quiet, wait_running
from tests.e2e.test_elastic_job import HostThread
from tests.jobs import get_status, tj_path
from tests.queueing import (
    EvictionSeen,
    Queues,
    assert_resumed_once,
    checkpoint_after_eviction,
    queued_job,
)
from tests.waiting import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

WORKER = Path(__file__).resolve().parents[1] / "runtime" / "elastic_worker.py"
SAMPLES, EPOCHS, BATCH = 512, 2, 4
HELD_AT = 20
"""The step the preempted job's workers wait at (a commit, between two checkpoint
intervals of 8) until their pods are being deleted, so the preemption finds the job
training whatever the machine's speed."""


def test_a_preempted_job_checkpoints_requeues_and_resumes_with_every_sample_once(
        kube: KubeClient, namespace: str, queues: Queues, tmp_path: Path) -> None:
    ns, root, gate = namespace, tmp_path / "checkpoints", tmp_path / "held"
    wait_quiet(kube, ns)
    # 2 pods of 4 GPUs (one CPU rank each) at priority 100, of a 16-GPU quota.
    low = queued_job("low", 2, 4, queues.local_queue, queues.priorities["low"])
    low["spec"]["workers"]["numProcPerNode"] = 1
    low["spec"]["checkpoint"] = {"path": str(root), "intervalSteps": 8}
    kube.create(tj_path(ns), low)
    gate.touch()
    env = {"TRACE_DIR": str(tmp_path / "pods" / "trace"), "EPOCHS": str(EPOCHS),
           "SAMPLES": str(SAMPLES), "BATCH": str(BATCH), "COMMIT_EVERY": "4",
           "STEP_SLEEP": "0.05", "OMP_NUM_THREADS": "1",
           "GATE_FILE": str(gate), "GATE_STEP": str(HELD_AT)}
    runner = HostThread(PodHost(kube, ns, "low", [sys.executable, str(WORKER)],
                                tmp_path / "pods", extra_env=env, readiness_grace=120,
                                graceful=True))
    evicted = EvictionSeen(kube, ns, "low")
    try:
        world, _ = wait_running(kube, ns, "low", 2)
        wait_for(lambda: runner.traces().max_step() >= HELD_AT, f"low: training to step {HELD_AT}",
                 timeout=SLOW)

        # 8 more GPUs at priority 1000 do not fit beside low's 8: Kueue preempts low.
        kube.create(tj_path(ns), queued_job("high", 3, 4, queues.local_queue,
                                            queues.priorities["high"]))
        wait_for(lambda: evicted.at, "low: its Workload evicted", timeout=SLOW)
        # The gate holds training until the pods are being deleted (their SIGTERM is
        # then handled at the next commit), so the job cannot finish first.
        wait_for(lambda: all(p["metadata"].get("deletionTimestamp")
                             for p in pods_of(kube, ns, "low")), "low: its pods deleted",
                 timeout=SLOW)
        gate.unlink()
        wait_for(lambda: get_status(kube, ns, "low").get("phase") == "Suspended"
                 and not pods_of(kube, ns, "low") and set(world.pods) <= set(runner.host.finished),
                 "low: Suspended, its pods gone and their processes ended", timeout=SLOW)
        # Each worker left at a commit when the world was emptied (exit 0), or took its
        # SIGTERM first (143), or was reached by it on its way out; either way rank 0
        # wrote where it stopped: no training is lost but the steps of the last commit.
        assert all(runner.host.finished[p][0] in (0, 128 + signal.SIGTERM, -signal.SIGTERM)
                   for p in world.pods), runner.host.finished
        stopped = checkpoint_after_eviction(runner.traces(), world.generation, root, HELD_AT,
                                            evicted, "")

        # high finishes: low is admitted again and resumes from that checkpoint.
        high, _ = wait_running(kube, ns, "high", 3)
        kube.merge_patch(api_path("v1", "pods", ns, high.members[0].pod, "status"),
                         {"status": {"phase": "Succeeded"}})
        wait_for(lambda: get_status(kube, ns, "low").get("phase") == "Succeeded",
                 "low: readmitted and trained to the end", timeout=2 * SLOW)
        history = assert_resumed_once(kube, ns, "low", runner.traces(), world.generation,
                                      stopped, SAMPLES, EPOCHS)
        phases = [p["phase"] for p in history]
        assert phases[-4:] == ["Suspended", "Pending", "Running", "Succeeded"], phases
    except BaseException:
        print(runner.tails(30))
        print("low:", get_status(kube, ns, "low"))
        raise
    finally:
        evicted.close()
        runner.close()
