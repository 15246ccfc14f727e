"""Parameter-server mode end to end: operator, local cluster, real PS and worker processes.

The pod host runs examples/ps_wide_and_deep.py for every Running pod with the pod's
environment (role, world ConfigMap, 127.x pod IP). PS pods serve on their pod IPs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from ringwright.devcluster.podhost import PodHost
from ringwright.kube import KubeClient, api_path
from ringwright.runtime.checkpoint.checkpointer import Checkpointer, LocalStorage, ps_shard
from ringwright.world import World, parse_world, world_configmap_name
from tests.e2e.test_elastic_job import HostThread
from tests.jobs import OperatorProcess, get_status, tj_path, training_job
from tests.ps.harness import ps_done
from tests.waiting import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ps_wide_and_deep.py"
SAMPLES = 4096


def _world(kube: KubeClient, ns: str) -> World | None:
    cm = kube.get_or_none(api_path("v1", "configmaps", ns, world_configmap_name("rec")))
    text = ((cm or {}).get("data") or {}).get("world.json")
    return parse_world(text) if text else None


def test_parameter_server_job_trains_every_sample_once(
        kube: KubeClient, namespace: str, operator: OperatorProcess, tmp_path: Path) -> None:
    ns = namespace
    container = [{"name": "train", "image": "ringwright/training:dev"}]
    manifest = training_job(
        "rec", replicas=2, minimum=1, gpusPerWorker=0, mode="ParameterServer",
        ps={"replicas": 2, "template": {"spec": {"containers": container}},
            "consistency": "Async", "staleness": 16})
    kube.create(tj_path(ns), manifest)
    host = PodHost(kube, ns, "rec",
                   [sys.executable, str(EXAMPLE), "--samples", str(SAMPLES), "--vocab", "500",
                    "--dim", "4", "--batch-size", "32", "--epochs", "2", "--slow", "0.01"],
                   tmp_path / "pods", readiness_grace=1)
    runner = HostThread(host)
    try:
        first = wait_for(lambda: (w := _world(kube, ns)) is not None and w.size == 2
                         and len(w.ps) == 2 and w, "a world with 2 workers and 2 PS",
                         timeout=180)
        assert isinstance(first, World) and first.ps_count == 2
        pods: list[dict[str, Any]] = kube.get(api_path("v1", "pods", ns))["items"]
        ps_pods = [p for p in pods if p["metadata"]["name"].startswith("rec-ps-")]
        workers = [p for p in pods if p["metadata"]["name"].startswith("rec-worker-")]
        assert len(ps_pods) == 2
        # PS pods outrank every worker: compared as the priorities the API server bound
        # on the pods at admission (spec.priority, the value of the pod's PriorityClass).
        bound = {p["metadata"]["name"]: p["spec"].get("priority") for p in pods}
        for p in pods:
            cls = kube.get(api_path("scheduling.k8s.io/v1", "priorityclasses",
                                    name=p["spec"]["priorityClassName"]))
            assert bound[p["metadata"]["name"]] == cls["value"], (p["metadata"]["name"], cls)
        ps_priority = [bound[p["metadata"]["name"]] for p in ps_pods]
        worker_priority = [bound[p["metadata"]["name"]] for p in workers]
        assert min(ps_priority) > max(worker_priority), bound
        # The job succeeds by the parameter-server completion rule: finished workers are
        # not replaced, and both servers outlive the last pushes and exit on their own.
        try:
            wait_for(lambda: get_status(kube, ns, "rec").get("phase") == "Succeeded",
                     "the job to succeed", timeout=300)
        except AssertionError as err:
            raise AssertionError(f"{err}\nstatus: {get_status(kube, ns, 'rec')}\n"
                                 f"{runner.tails()}") from err
        done = runner.log_lines(r" ps_done ")
        assert len(done) == 2, done
        counts = ps_done("\n".join(line for line in done if "trained=" in line))
        for epoch in range(2):
            assert counts["trained"].get(epoch, 0) + counts["dropped"].get(epoch, 0) == SAMPLES
        assert len(runner.log_lines(r" ps_worker_done ")) == 2
        assert runner.log_lines(r" ps_serving index=0 address=127\.")
        status = get_status(kube, ns, "rec")
        assert status.get("ps", {}).get("desired") == 2
        assert status.get("restarts", 0) == 0
        # One process per pod: nothing finished was replaced or restarted.
        assert dict(host.starts) == {f"rec-{role}-{i}": 1 for role in ("worker", "ps")
                                     for i in range(2)}
    finally:
        runner.close()


def test_a_suspended_parameter_server_job_resumes_from_its_checkpoints(
        kube: KubeClient, namespace: str, operator: OperatorProcess, tmp_path: Path) -> None:
    ns, root = namespace, tmp_path / "checkpoints"
    container = [{"name": "train", "image": "ringwright/training:dev"}]
    manifest = training_job(
        "nap", replicas=2, minimum=1, gpusPerWorker=0, mode="ParameterServer",
        ps={"replicas": 2, "template": {"spec": {"containers": container}},
            "consistency": "Async", "staleness": 16},
        checkpoint={"path": str(root), "intervalSteps": 5})
    kube.create(tj_path(ns), manifest)
    host = PodHost(kube, ns, "nap",
                   [sys.executable, str(EXAMPLE), "--samples", str(SAMPLES // 2), "--vocab", "500",
                    "--dim", "4", "--batch-size", "32", "--epochs", "3", "--slow", "0.03"],
                   tmp_path / "pods", readiness_grace=1)
    runner = HostThread(host)
    shard0 = Checkpointer(LocalStorage(root), shard=ps_shard(0))
    try:
        wait_for(lambda: root.exists() and max(shard0.steps(), default=0) >= 10,
                 "shard 0 checkpointed at version 10", timeout=180)
        kube.merge_patch(tj_path(ns, "nap"), {"spec": {"runPolicy": {"suspend": True}}})
        wait_for(lambda: get_status(kube, ns, "nap").get("phase") == "Suspended"
                 and not kube.get(api_path("v1", "pods", ns))["items"], "every pod gone",
                 timeout=120)
        assert not runner.log_lines(r" ps_done ")  # stopped mid-training
        kube.merge_patch(tj_path(ns, "nap"), {"spec": {"runPolicy": {"suspend": False}}})
        try:
            wait_for(lambda: get_status(kube, ns, "nap").get("phase") == "Succeeded",
                     "the resumed job to succeed", timeout=300)
        except AssertionError as err:
            raise AssertionError(f"{err}\n{runner.tails()}") from err
        restored = runner.log_lines(r" ps_restored ")
        assert {line.split("shard=")[1].split()[0] for line in restored} == {"0", "1"}, restored
        # The data queue came back with shard 0: every sample of every epoch once, by
        # the queue's count, across the two runs.
        done = runner.log_lines(r" ps_done ")
        counts = ps_done("\n".join(line for line in done if "trained=" in line))
        for epoch in range(3):
            assert counts["trained"].get(epoch, 0) + counts["dropped"].get(epoch, 0) == \
                SAMPLES // 2, (epoch, counts)
    finally:
        runner.close()
