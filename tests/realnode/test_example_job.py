"""`examples/trainingjob-demo.yaml` (one overlay, below) trains in real containers of
the `training` image on the real nodes (CPU and gloo; its GPU request is met by the
nodes' advertised `nvidia.com/gpu`), and survives what users and nodes do to it: a
worker's pod deleted with `kubectl delete pod` (the runtime exits 143 on the kubelet's
SIGTERM), a training process killed inside its container (the kubelet restarts the
container), and `kubectl scale` up.

The example carries no toleration for the real nodes' taint and names no node, so for
this module the real nodes are made plain nodes (their taint removed) and the KWOK
nodes are cordoned, both as `kubectl taint` and `kubectl cordon` would, and put back
after: the job lands on real nodes through the operator's own placement.

The test worker (``tests/runtime/elastic_worker.py``, staged on a hostPath with its
traces, as the image carries no tests) takes the same two faults and runs to its end:
every sample of every epoch is trained exactly once, and the ranks end bit-identical.

Beside it, jobs of the same image under a SchedulingPolicy with a 10 s unready limit:
workers that sleep 120 s before training join late and are never taken for lost
members (their startupGraceSeconds covers the wait), while containers that exit at once
crash-loop and fail their job.

One overlay, as a user's kustomization would add it: ``args: [--epochs, ...]`` on the
training container. The example's 20 epochs end within a minute on these CPUs, before
a deleted worker's replacement can rejoin (seen: the job Succeeded at a world of 3).
"""

from __future__ import annotations

import contextlib
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ringwright.devcluster.demo import current_world
from ringwright.devcluster.example import LONG_EPOCHS, example, training_container, with_epochs
from ringwright.devcluster.realnode import RealNodeSet, crash_container
from ringwright.devcluster.realnode_only import real_nodes_only as plain_real_nodes
from ringwright.kube import ApiError, KubeClient, api_path
from ringwright.objects import Obj
from ringwright.runtime.checkpoint.checkpointer import Checkpointer
from ringwright.runtime.checkpoint.storage import storage_for
from ringwright.world import World
from tests.jobs import OperatorProcess, get_status, tj_path
from tests.realnode.staging import MOUNT, hostpath_policy, run_staged_worker, stage_worker
from tests.runtime.elastic_traces import (
    Traces,
    assert_every_sample_once,
    assert_params_identical,
)
from tests.waiting import wait_for
from tests.xdist_groups import REALNODE_GROUP

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.xdist_group(REALNODE_GROUP),
              pytest.mark.timeout(1800)]

NODE_IMAGES = ("training", "training-horovod")
"""The image the nodes start with (tests/realnode/conftest.py)."""
JOB = "resnet"
"""The example's job name."""


@pytest.fixture()
def real_nodes_only(kube: KubeClient, real_nodes: RealNodeSet) -> Iterator[None]:
    """KWOK nodes cordoned and the real nodes' taint removed; both put back after."""
    with plain_real_nodes(kube, real_nodes.names):
        yield


def _world_where(kube: KubeClient, ns: str, size: int, after: int,
                 job: str = JOB) -> World | None:
    """Job ``job``'s world when it has ``size`` members and a generation past ``after``."""
    world = current_world(kube, ns, job)
    return world if world and world.size == size and world.generation > after else None


STEP = re.compile(r" epoch_done .*\bstep=(\d+)")
"""The example's line at the end of every epoch (its rank 0 logs it)."""


def _trained_step(kube: KubeClient, ns: str) -> int:
    """The latest step an epoch ended at, in the logs of the job's pods now."""
    steps = [0]
    for pod in kube.list(api_path("v1", "pods", ns)):
        try:
            text = kube.get_text(api_path("v1", "pods", ns, pod["metadata"]["name"],
                                          subresource="log"))
        except (ApiError, OSError):
            continue
        steps += [int(m.group(1)) for m in STEP.finditer(text)]
    return max(steps)


def _trained_past(kube: KubeClient, ns: str, step: int, timeout: float = 300) -> int:
    """Wait for an epoch to end after step ``step`` (training went on); its step."""
    return wait_for(lambda: s if (s := _trained_step(kube, ns)) > step else None,
                    f"an epoch to end after step {step}", timeout=timeout, interval=2)


SIGTERM_EXIT = 128 + signal.SIGTERM
"""How the runtime exits after the kubelet's SIGTERM (once its last checkpoint is out)."""


def _exit_code_until_gone(kube: KubeClient, ns: str, name: str, version: str) -> int | None:
    """The exit code pod ``name``'s container last reported before the pod was deleted
    (watched from ``version`` on, so no status in between is missed)."""
    code = None
    for event in kube.watch(api_path("v1", "pods", ns), resource_version=version,
                            timeout_seconds=180, fieldSelector=f"metadata.name={name}"):
        statuses = (event["object"].get("status") or {}).get("containerStatuses") or []
        for status in statuses:
            if finished := (status.get("state") or {}).get("terminated"):
                code = int(finished["exitCode"])
        if event["type"] == "DELETED":
            break
    return code


@contextlib.contextmanager
def diagnosed(kube: KubeClient, ns: str) -> Iterator[None]:
    """On a failed assertion or wait, add what a user would look at: the job's status,
    its events and the tails of its pods' logs (the pods go with the namespace)."""
    try:
        yield
    except AssertionError as err:
        jobs = kube.list(tj_path(ns))
        events = sorted(kube.list(api_path("v1", "events", ns)),
                        key=lambda e: e.get("lastTimestamp") or "")
        raise AssertionError(
            f"{err}\n--- status\n" + "\n".join(yaml.safe_dump(j.get("status")) for j in jobs)
            + "--- events\n" + "\n".join(
                f"{e.get('lastTimestamp')} {e['involvedObject'].get('name')} {e.get('reason')}: "
                f"{e.get('message')}" for e in events[-40:])
            + "\n" + _logs(kube, ns)) from None


def _pod(kube: KubeClient, ns: str, name: str) -> Obj:
    return kube.get(api_path("v1", "pods", ns, name))


def _logs(kube: KubeClient, ns: str) -> str:
    out = []
    for pod in kube.list(api_path("v1", "pods", ns)):
        name = pod["metadata"]["name"]
        try:
            text = kube.get_text(api_path("v1", "pods", ns, name, subresource="log"))
        except (ApiError, OSError) as err:
            text = f"(no log: {err})"
        out.append(f"--- {name}\n" + "\n".join(text.splitlines()[-15:]))
    return "\n".join(out)


def test_the_example_trains_in_real_containers_and_survives_pod_and_container_loss(
    kube: KubeClient, namespace: str, operator: OperatorProcess, real_nodes: RealNodeSet,
    training_image: str, real_nodes_only: None,
) -> None:
    with diagnosed(kube, namespace):
        manifest = example()
        container = training_container(manifest)
        assert container["image"] == training_image
        assert "args" not in container
        kube.create(tj_path(namespace), with_epochs(manifest, LONG_EPOCHS))

        first = wait_for(lambda: _world_where(kube, namespace, 4, 0),
                         "a world of the example's 4 workers", timeout=900)
        nodes = {_pod(kube, namespace, m.pod)["spec"]["nodeName"] for m in first.members}
        assert nodes <= set(real_nodes.names)
        _trained_past(kube, namespace, 0, timeout=600)

        # `kubectl delete pod` of a worker: the kubelet's SIGTERM, within the grace period,
        # ends the runtime with 143; a world of 3 goes on, then the replacement joins.
        step = _trained_step(kube, namespace)
        victim = first.members[-1].pod
        version = _pod(kube, namespace, victim)["metadata"]["resourceVersion"]
        kube.delete(api_path("v1", "pods", namespace, victim))
        assert _exit_code_until_gone(kube, namespace, victim, version) == SIGTERM_EXIT
        smaller = wait_for(lambda: _world_where(kube, namespace, 3, first.generation),
                           "a world of 3 without the deleted pod", timeout=300)
        assert victim not in {m.pod for m in smaller.members}
        healed = wait_for(lambda: _world_where(kube, namespace, 4, smaller.generation),
                          "a world of 4 again", timeout=600)
        _trained_past(kube, namespace, step)

        # A training process killed inside its container: the kubelet restarts the
        # container in the same pod, which rejoins.
        step = _trained_step(kube, namespace)
        target = healed.members[0].pod
        before = _pod(kube, namespace, target)
        assert crash_container(before), f"no process of {target}'s container found"
        wait_for(lambda: _pod(kube, namespace, target)["status"]["containerStatuses"][0]
                 .get("restartCount", 0) >= 1, "the kubelet to restart the container", timeout=300)
        after = _pod(kube, namespace, target)
        assert after["metadata"]["uid"] == before["metadata"]["uid"]

        def rejoined() -> World | None:
            world = _world_where(kube, namespace, 4, healed.generation)
            return world if world and target in {m.pod for m in world.members} else None

        back = wait_for(rejoined, "a world of 4 with the restarted container", timeout=600)
        _trained_past(kube, namespace, step)

        # `kubectl scale trainingjob resnet --replicas=5`: a fifth worker joins.
        step = _trained_step(kube, namespace)
        kube.merge_patch(tj_path(namespace, JOB, "scale"), {"spec": {"replicas": 5}})
        grown = wait_for(lambda: _world_where(kube, namespace, 5, back.generation),
                         "a world of 5 after kubectl scale", timeout=600)
        assert {_pod(kube, namespace, m.pod)["spec"]["nodeName"] for m in grown.members} \
            <= set(real_nodes.names)
        _trained_past(kube, namespace, step)


SLOW_START = 120
"""Seconds a slow worker spends before it starts training (loading data, say)."""
UNREADY_SECONDS = 10
"""The policy's unready limit for these jobs: far below the slow start, so only the
startup grace keeps a slow worker from being taken for a lost member."""


@pytest.fixture()
def strict_policy(kube: KubeClient, namespace: str) -> Iterator[str]:
    """A SchedulingPolicy whose unready limit is :data:`UNREADY_SECONDS`; its name."""
    name = f"{namespace}-strict"
    path = api_path("ringwright.dev/v1alpha1", "schedulingpolicies", name=name)
    kube.create(api_path("ringwright.dev/v1alpha1", "schedulingpolicies"), {
        "apiVersion": "ringwright.dev/v1alpha1", "kind": "SchedulingPolicy",
        "metadata": {"name": name},
        "spec": {"nodeLoss": {"tolerationSeconds": 30, "unreadySeconds": UNREADY_SECONDS}}})
    try:
        yield name
    finally:
        kube.delete(path)


def _job(name: str, image: str, policy: str, command: list[str], backend: str = "torch",
         **workers: object) -> Obj:
    """A CPU job of the training image for the real nodes."""
    return {
        "apiVersion": "ringwright.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "backend": backend, "gpusPerWorker": 0, "schedulingPolicyName": policy,
            "workers": {"min": 2, "replicas": 2, "max": 2, **workers, "template": {"spec": {
                "containers": [{"name": "train", "image": image, "command": command}]}}},
            "runPolicy": {"backoffLimit": 2},
        },
    }


def _pod_uids(kube: KubeClient, ns: str) -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["uid"]
            for p in kube.list(api_path("v1", "pods", ns))}


def test_a_worker_sleeping_before_training_joins_late_and_is_never_lost(
    kube: KubeClient, namespace: str, operator: OperatorProcess, real_nodes: RealNodeSet,
    training_image: str, real_nodes_only: None, strict_policy: str,
) -> None:
    command = ["sh", "-c", f"sleep {SLOW_START} && exec python "
               "/app/examples/train_elastic.py --epochs 100000"]
    kube.create(tj_path(namespace), _job("slow", training_image, strict_policy, command,
                                         startupGraceSeconds=SLOW_START * 3))

    def running_pods() -> dict[str, str] | None:
        pods = [p for p in kube.list(api_path("v1", "pods", namespace))
                if p["status"].get("phase") == "Running"]
        return {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods} \
            if len(pods) == 2 else None

    first = wait_for(running_pods, "both slow workers' containers to run", timeout=600)
    def world_of_two() -> World | None:
        world = current_world(kube, namespace, "slow")
        return world if world is not None and world.size == 2 else None

    world = wait_for(world_of_two, "the slow workers to form a world of 2",
                     timeout=SLOW_START + 600)
    assert {m.pod for m in world.members} == set(first)
    assert _pod_uids(kube, namespace) == first, "a slow worker was replaced"
    # The world goes out before the status that mirrors it (same round, next write).
    status = wait_for(lambda: (s := get_status(kube, namespace, "slow")).get("phase")
                      == "Running" and s, "the job Running", timeout=60)
    assert status.get("restarts", 0) == 0, status


def test_a_real_crash_loop_is_still_a_failure(
    kube: KubeClient, namespace: str, operator: OperatorProcess, real_nodes: RealNodeSet,
    training_image: str, real_nodes_only: None, strict_policy: str,
) -> None:
    """Containers that exit at once, again and again, within the startup grace: the
    kubelet's restarts count toward backoffLimit and the job fails."""
    kube.create(tj_path(namespace), _job("crashing", training_image, strict_policy,
                                         ["sh", "-c", "exit 3"]))
    status = wait_for(
        lambda: s if (s := get_status(kube, namespace, "crashing")).get("phase") == "Failed"
        else None, "the crash-looping job to fail", timeout=600)
    assert status.get("restarts", 0) >= 1, status


WORLD_READY = re.compile(r" world_ready generation=(\d+) .*\bfrom_checkpoint=(\w+) step=(\d+)")
"""The runtime's line when a member starts training in a world."""


def test_a_suspended_job_flushes_its_checkpoint_to_a_shared_volume_and_resumes_from_it(
    kube: KubeClient, namespace: str, operator: OperatorProcess, real_nodes: RealNodeSet,
    training_image: str, real_nodes_only: None, tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """`spec.runPolicy.suspend: true`: the operator publishes an empty world, then deletes
    the pods. Rank 0 writes the final checkpoint to a volume both nodes see (a hostPath of
    one folder of this host, as an RWX claim is on a real cluster), whichever reaches it
    first: the empty world (it leaves, exit 0) or the kubelet's SIGTERM (exit 143); a
    worker killed at the end of its grace period would fail the test. `suspend: false`
    recreates the pods, which restore from it. Periodic checkpoints are off, so the only
    checkpoint is the one the stop flushed."""
    shared = tmp_path / "checkpoints"
    shared.mkdir()
    shared.chmod(0o777)  # the image runs as uid 10001; a hostPath gets no fsGroup
    policy = hostpath_policy(kube, namespace, shared)
    request.addfinalizer(lambda: kube.delete(
        api_path("ringwright.dev/v1alpha1", "schedulingpolicies", name=policy)))
    job = _job("suspended", training_image, policy,
               ["python", "/app/examples/train_elastic.py", "--epochs", str(LONG_EPOCHS)])
    template = job["spec"]["workers"]["template"]["spec"]
    template["containers"][0]["volumeMounts"] = [{"name": "ckpt", "mountPath": "/ckpt"}]
    template["volumes"] = [{"name": "ckpt",
                            "hostPath": {"path": str(shared), "type": "Directory"}}]
    job["spec"]["checkpoint"] = {"path": "/ckpt"}
    kube.create(tj_path(namespace), job)

    def world_of(size: int, after: int) -> World | None:
        return _world_where(kube, namespace, size, after, "suspended")

    first = wait_for(lambda: world_of(2, -1), "a world of 2", timeout=900)
    _trained_past(kube, namespace, 0, timeout=600)
    assert Checkpointer(storage_for(str(shared))).steps() == [], "no periodic checkpoints"

    versions = {m.pod: _pod(kube, namespace, m.pod)["metadata"]["resourceVersion"]
                for m in first.members}
    kube.merge_patch(tj_path(namespace, "suspended"),
                     {"spec": {"runPolicy": {"suspend": True}}})
    codes = {pod: _exit_code_until_gone(kube, namespace, pod, version)
             for pod, version in versions.items()}
    assert set(codes.values()) <= {0, SIGTERM_EXIT}, codes
    flushed = Checkpointer(storage_for(str(shared))).steps()
    assert flushed and flushed[-1] > 0, f"no checkpoint flushed when the job stopped: {flushed}"
    assert get_status(kube, namespace, "suspended").get("phase") == "Suspended"

    kube.merge_patch(tj_path(namespace, "suspended"),
                     {"spec": {"runPolicy": {"suspend": False}}})
    resumed = wait_for(lambda: world_of(2, first.generation), "a world of 2 after resuming",
                       timeout=900)

    def restored() -> list[tuple[bool, int]] | None:
        starts = []
        for m in resumed.members:
            try:
                text = kube.get_text(api_path("v1", "pods", namespace, m.pod,
                                              subresource="log"))
            except (ApiError, OSError):
                return None
            starts += [(found.group(2) == "True", int(found.group(3)))
                       for found in WORLD_READY.finditer(text)
                       if int(found.group(1)) == resumed.generation]
        return starts if len(starts) == len(resumed.members) else None

    starts = wait_for(restored, "both resumed workers to start training", timeout=600)
    # One member reads the checkpoint and the others get its state by broadcast: all
    # start at the flushed step.
    assert {step for _, step in starts} == {flushed[-1]}, (starts, _logs(kube, namespace))
    assert sorted(from_disk for from_disk, _ in starts) == [False, True], starts


def test_the_horovod_images_job_survives_a_deleted_pod(
    kube: KubeClient, namespace: str, operator: OperatorProcess, real_nodes: RealNodeSet,
    horovod_image: str, real_nodes_only: None,
) -> None:
    """The example script in the ``training-horovod`` image with ``backend: horovod``: three
    workers train, one pod is deleted (exit 143 on SIGTERM), the other two go on in a world
    of 2 and the replacement joins a world of 3 again."""
    job = _job("hvd", horovod_image, "default",
               ["python", "/app/examples/train_elastic.py", "--epochs", str(LONG_EPOCHS)],
               backend="horovod", replicas=3, max=3)

    def world_of(size: int, after: int) -> World | None:
        return _world_where(kube, namespace, size, after, "hvd")

    with diagnosed(kube, namespace):
        kube.create(tj_path(namespace), job)
        first = wait_for(lambda: world_of(3, -1), "a world of 3", timeout=900)
        step = _trained_past(kube, namespace, 0, timeout=600)
        victim = first.members[-1].pod
        version = _pod(kube, namespace, victim)["metadata"]["resourceVersion"]
        kube.delete(api_path("v1", "pods", namespace, victim))
        assert _exit_code_until_gone(kube, namespace, victim, version) == SIGTERM_EXIT
        smaller = wait_for(lambda: world_of(2, first.generation), "a world of 2", timeout=300)
        assert victim not in smaller.pods
        wait_for(lambda: world_of(3, smaller.generation), "a world of 3 again", timeout=600)
        _trained_past(kube, namespace, step)


ACCOUNTED = {"EPOCHS": "2", "SAMPLES": "2304", "BATCH": "4", "COMMIT_EVERY": "4",
             "STEP_SLEEP": "0.2", "STEP_SLEEP_FILE": f"{MOUNT}/step-sleep",
             "OMP_NUM_THREADS": "1"}
"""About 190 steps per epoch at three workers: the job outlasts both faults and their
rejoins, then ends by itself, faster once the last rejoin has trained (STEP_SLEEP_FILE)."""


def test_every_sample_is_trained_once_through_a_deleted_pod_and_a_killed_container(
    kube: KubeClient, namespace: str, operator: OperatorProcess, real_nodes: RealNodeSet,
    training_image: str, real_nodes_only: None, tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    folder = tmp_path / "bench"
    traces = stage_worker(folder)
    policy = hostpath_policy(kube, namespace, folder)
    request.addfinalizer(lambda: kube.delete(
        api_path("ringwright.dev/v1alpha1", "schedulingpolicies", name=policy)))
    job = _job("accounted", training_image, policy, [], replicas=3, max=3)
    run_staged_worker(job["spec"]["workers"]["template"]["spec"], training_image, folder,
                      ACCOUNTED)

    def world_of(size: int, after: int) -> World | None:
        return _world_where(kube, namespace, size, after, "accounted")

    def trained_in(world: World) -> None:
        wait_for(lambda: set(world.pods) <= Traces.load(traces).trained(world.generation),
                 f"every member training in generation {world.generation}", timeout=600)

    with diagnosed(kube, namespace):
        kube.create(tj_path(namespace), job)
        first = wait_for(lambda: world_of(3, -1), "a world of 3", timeout=900)
        trained_in(first)

        # `kubectl delete pod`: the kubelet's SIGTERM; the others go on, the replacement
        # (under the same name) joins.
        victim = first.members[-1].pod
        version = _pod(kube, namespace, victim)["metadata"]["resourceVersion"]
        kube.delete(api_path("v1", "pods", namespace, victim))
        assert _exit_code_until_gone(kube, namespace, victim, version) == SIGTERM_EXIT
        smaller = wait_for(lambda: world_of(2, first.generation), "a world of 2", timeout=300)
        healed = wait_for(lambda: world_of(3, smaller.generation), "a world of 3 again",
                          timeout=600)
        trained_in(healed)

        # A training process killed inside its container: the kubelet restarts it.
        target = healed.members[0].pod
        assert crash_container(_pod(kube, namespace, target)), f"no process of {target}"
        def rejoined() -> World | None:
            world = world_of(3, healed.generation)
            return world if world is not None and target in world.pods else None

        back = wait_for(rejoined, "a world of 3 with the restarted container", timeout=600)
        trained_in(back)

        # Both faults are behind: the rest only has to be trained once.
        (folder / "step-sleep").write_text("0.02")
        wait_for(lambda: get_status(kube, namespace, "accounted").get("phase") == "Succeeded",
                 "the job to train to its end", timeout=900, interval=2)
    t = Traces.load(traces)
    assert_every_sample_once(t, int(ACCOUNTED["SAMPLES"]), int(ACCOUNTED["EPOCHS"]))
    assert_params_identical(t)
