"""Parameter-server mode end to end: operator, local cluster, real PS and worker processes.

The pod host runs examples/ps_wide_and_deep.py for every Running pod with the pod's
environment (role, world ConfigMap, 127.x pod IP). PS pods serve on their pod IPs.
"""

from __future__ import annotations

import json
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
from tests.ps.harness import moved, ps_done
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


RESIZE_SAMPLES = 3072
RESIZE_EPOCHS = 8


def test_a_running_job_grows_its_servers_2_to_3_and_back_by_its_spec(
        kube: KubeClient, namespace: str, operator: OperatorProcess, tmp_path: Path) -> None:
    """spec.ps.replicas patched 2 -> 3 -> 2 under training: the operator creates rec-ps-2
    and counts it once it is ready, so shard 2 moves to it; then leaves it out, so it hands
    shard 2 back to rec-ps-0 and exits 0, and its pod is deleted, neither counted as a
    failure nor replaced. Every sample of every epoch is trained exactly once (re-queue of
    stale drops on), by the data service's count and by the workers' traces, and no
    update is lost: each shard's final version is the steps the workers count as applied."""
    ns, trace = namespace, tmp_path / "steps.trace"
    container = [{"name": "train", "image": "ringwright/training:dev"}]
    manifest = training_job(
        "rec", replicas=2, minimum=1, gpusPerWorker=0, mode="ParameterServer",
        ps={"replicas": 2, "shards": 3, "template": {"spec": {"containers": container}},
            "consistency": "Async", "staleness": 16, "requeueStale": True})
    kube.create(tj_path(ns), manifest)
    # One trace for both workers: each step is one appended line.
    host = PodHost(kube, ns, "rec",
                   [sys.executable, str(EXAMPLE), "--samples", str(RESIZE_SAMPLES),
                    "--vocab", "300", "--dim", "4", "--batch-size", "32", "--piece-batches",
                    "4", "--epochs", str(RESIZE_EPOCHS), "--slow", "0.03", "--trace", str(trace)],
                   tmp_path / "pods", readiness_grace=1)
    runner = HostThread(host)

    def steps() -> list[dict[str, Any]]:
        text = trace.read_text() if trace.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def logged(pod: str, pattern: str) -> list[str]:
        return [line for line in runner.log_lines(pattern) if line.startswith(f"{pod} ")]

    def resize(replicas: int) -> None:
        kube.merge_patch(tj_path(ns, "rec"), {"spec": {"ps": {"replicas": replicas}}})

    try:
        try:
            wait_for(lambda: len(steps()) >= 20, "20 steps on two servers", timeout=180)
            resize(3)
            grown = wait_for(lambda: (w := _world(kube, ns)) is not None and w.ps_count == 3
                             and len(w.ps) == 3 and w, "a world of 3 servers", timeout=120)
            wait_for(lambda: logged("rec-ps-0", "ps_moved shard=2 to=2 "),
                     "shard 2 handed to rec-ps-2", timeout=120)
            assert get_status(kube, ns, "rec")["world"]["psServers"] == 3
            on_three = len(steps())
            wait_for(lambda: len(steps()) >= on_three + 20, "20 steps on three servers",
                     timeout=120)
            resize(2)
            wait_for(lambda: logged("rec-ps-2", "ps_moved shard=2 to=0 "),
                     "shard 2 handed back to rec-ps-0", timeout=120)
            wait_for(lambda: kube.get_or_none(api_path("v1", "pods", ns, "rec-ps-2")) is None,
                     "rec-ps-2 drained and deleted", timeout=120)
            shrunk = _world(kube, ns)
            assert shrunk is not None and shrunk.ps_count == 2, shrunk
            assert [m.pod for m in shrunk.ps] == ["rec-ps-0", "rec-ps-1"]
            assert not runner.log_lines(r" ps_done "), "training ended before the shrink"
            wait_for(lambda: get_status(kube, ns, "rec").get("phase") == "Succeeded",
                     "the job to succeed", timeout=300)
        except AssertionError as err:
            raise AssertionError(f"{err}\nstatus: {get_status(kube, ns, 'rec')}\n"
                                 f"{runner.tails()}") from err
        assert isinstance(grown, World) and [m.pod for m in grown.ps] == [
            "rec-ps-0", "rec-ps-1", "rec-ps-2"]
        assert logged("rec-ps-2", r" ps_left_world .*primaries=0"), runner.tails()
        status = get_status(kube, ns, "rec")
        assert status.get("restarts", 0) == 0, status
        assert status["ps"]["desired"] == 2 and status["world"]["psServers"] == 2
        # Each pod's process started once: the drained server was not replaced.
        assert dict(host.starts) == {**{f"rec-worker-{i}": 1 for i in range(2)},
                                     **{f"rec-ps-{i}": 1 for i in range(3)}}
        reasons = [e["reason"] for e in kube.list(api_path("v1", "events", ns))]
        for reason in ("ServersResized", "ServerLeaving", "ServerDrained"):
            assert reason in reasons, reasons
        # Every sample of every epoch trained exactly once; drops counted and re-queued.
        traced = steps()
        done = runner.log_lines(r" ps_done ")
        counts = ps_done("\n".join(line for line in done if "trained=" in line))
        for epoch in range(RESIZE_EPOCHS):
            mine = [s for s in traced if s["epoch"] == epoch]
            covered = [0] * RESIZE_SAMPLES
            for s in mine:
                if not s["dropped"]:
                    for i in range(s["start"], s["stop"]):
                        covered[i] += 1
            assert covered == [1] * RESIZE_SAMPLES, epoch
            assert counts["trained"][epoch] == RESIZE_SAMPLES, counts
            dropped = sum(s["samples"] for s in mine if s["dropped"])
            assert counts["dropped"].get(epoch, 0) == dropped, counts
            assert counts["requeued_stale"].get(epoch, 0) == dropped, counts
        # No update lost: every shard, wherever it ended, applied each applied step once.
        versions: dict[int, int] = {}
        for line in done:
            versions.update(ps_done(line)["versions"])
        applied = sum(1 for s in traced if not s["dropped"])
        assert versions == dict.fromkeys(range(3), applied), (versions, applied)
        for pod, needle in (("rec-ps-0", "ps_moved shard=2 to=2 "),
                            ("rec-ps-2", "ps_moved shard=2 to=0 ")):
            move = moved(logged(pod, needle)[0])
            print(f"{pod} handed shard 2 to ps-{int(move['to'])} at version "
                  f"{int(move['version'])}: served by nobody {move['held_s'] * 1000:.1f} ms")
    finally:
        runner.close()
