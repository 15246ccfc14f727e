"""Operator + pods of three local ranks on the local cluster (gloo on CPU).

``numProcPerNode: 3`` on a CPU job: the operator publishes three ranks per pod, and the
pod host starts the pod entry point (``ringwright.runtime.launch``), as the operator's
wrapped command does in a real pod. One local rank is killed (its pod's ranks go
together and the pod host restarts the container, as the kubelet does), then the job
grows from two pods to three; every sample is trained exactly once.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from ringwright.devcluster.podhost import PodHost
from ringwright.kube import KubeClient
from ringwright.world import Env, World
from tests.e2e.test_elastic_job import HostThread, world_where
from tests.jobs import OperatorProcess, tj_path, training_job
from tests.runtime.elastic_traces import (
    assert_every_sample_once,
    assert_params_identical,
    assert_resumed_from_commit,
)
from tests.waiting import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

WORKER = Path(__file__).resolve().parents[1] / "runtime" / "elastic_worker.py"
LOCAL = 3
SAMPLES, EPOCHS, GATE_STEP = 384, 6, 60


def processes(world: World) -> set[str]:
    """The trace names of ``world``'s ranks (``<pod>.<local rank>``)."""
    return {f"{m.pod}.{m.local_rank}" for m in world.members}


def local_ranks_of(host: PodHost, pod: str) -> dict[int, int]:
    entry = host.pods[pod].proc.pid
    out = {}
    for pid in Path(f"/proc/{entry}/task/{entry}/children").read_text().split():
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        local = next(v for v in env if v.startswith(Env.LOCAL_RANK.encode() + b"="))
        out[int(local.split(b"=", 1)[1])] = int(pid)
    return out


def test_pods_of_three_ranks_survive_a_rank_kill_and_grow(
        kube: KubeClient, namespace: str, operator: OperatorProcess, tmp_path: Path) -> None:
    ns = namespace
    manifest = training_job("elastic", replicas=2, minimum=1, gpusPerWorker=0)
    manifest["spec"]["workers"]["numProcPerNode"] = LOCAL
    kube.create(tj_path(ns), manifest)
    gate = tmp_path / "gate"
    gate.touch()
    env = {"TRACE_DIR": str(tmp_path / "pods" / "trace"), "EPOCHS": str(EPOCHS),
           "SAMPLES": str(SAMPLES), "BATCH": "4", "COMMIT_EVERY": "4", "STEP_SLEEP": "0.05",
           "OMP_NUM_THREADS": "1", "GATE_FILE": str(gate), "GATE_STEP": str(GATE_STEP)}
    runner = HostThread(PodHost(kube, ns, "elastic", [sys.executable, str(WORKER)],
                                tmp_path / "pods", extra_env=env, readiness_grace=120))
    try:
        first = wait_for(lambda: world_where(kube, ns, 2 * LOCAL), "a world of 2 x 3",
                         timeout=120)
        assert [(m.rank, m.local_rank) for m in first.members] == [
            (i, i % LOCAL) for i in range(2 * LOCAL)]
        wait_for(lambda: processes(first) <= runner.traces().trained(first.generation),
                 "every rank to train", timeout=180)

        victim = first.members[LOCAL].pod
        os.kill(local_ranks_of(runner.host, victim)[1], signal.SIGKILL)
        again = wait_for(lambda: world_where(kube, ns, 2 * LOCAL, after=first.generation),
                         "the same pods in a new generation", timeout=180)
        wait_for(lambda: processes(again) <= runner.traces().trained(again.generation),
                 "every rank, the restarted ones too, to train again", timeout=240)
        assert runner.host.starts[victim] == 2 and runner.host.starts[first.pods[0]] == 1
        assert runner.host.finished[victim] == [128 + signal.SIGKILL]

        kube.merge_patch(tj_path(ns, "elastic", "scale"), {"spec": {"replicas": 3}})
        grown = wait_for(lambda: world_where(kube, ns, 3 * LOCAL), "a world of 3 x 3",
                         timeout=180)
        gate.unlink()
        wait_for(lambda: all(codes[-1:] == [0] for pod, codes in runner.host.finished.items()
                             if pod in grown.pods) and set(grown.pods) <= set(
                                 runner.host.finished), "every pod to finish", timeout=300)
        t = runner.traces()
        assert_every_sample_once(t, SAMPLES, EPOCHS)
        assert_params_identical(t)
        assert processes(grown) <= set(t.starts(grown.generation))
        assert_resumed_from_commit(t, before=again.generation, after=grown.generation)
    except BaseException:
        print(runner.tails(30))
        raise
    finally:
        runner.close()
