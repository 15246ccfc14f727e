"""Operator + real runtime processes on the local cluster: a job that survives failures.

The pod host starts `examples/train_elastic.py` for every Running pod of the job, with
the pod's environment, its 127.x pod IP and a token of the pod's ServiceAccount, so the
runtime watches its world through the API exactly as it would in a real pod.
"""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ringwright.devcluster.podhost import PodHost
from ringwright.kube import KubeClient, api_path
from ringwright.world import World, parse_world, world_configmap_name
from tests.jobs import OperatorProcess, get_status, tj_path, training_job
from tests.waiting import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_elastic.py"


class HostThread:
    """Keeps a :class:`PodHost` in step with the cluster from a background thread."""

    def __init__(self, host: PodHost) -> None:
        self.host = host
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.host.sync()
            self.stop.wait(0.2)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.host.close()

    def log_lines(self, pattern: str) -> list[str]:
        out = []
        for path in sorted(self.host.workdir.glob("*.log")):
            out += [f"{path.stem} {line}" for line in path.read_text(errors="replace")
                    .splitlines() if re.search(pattern, line)]
        return out


@pytest.fixture(params=["torch", pytest.param("horovod", marks=pytest.mark.horovod)])
def job(kube: KubeClient, namespace: str, operator: OperatorProcess, tmp_path: Path,
        request: pytest.FixtureRequest) -> Iterator[tuple[str, HostThread]]:
    manifest = training_job("elastic", replicas=3, minimum=2, gpusPerWorker=0,
                            backend=request.param,
                            lrScaling={"rule": "linear", "baseWorldSize": 3})
    kube.create(tj_path(namespace), manifest)
    host = PodHost(kube, namespace, "elastic",
                   [sys.executable, str(EXAMPLE), "--epochs", "400", "--samples", "1024",
                    "--commit-every", "5"], tmp_path / "pods", readiness_grace=120)
    runner = HostThread(host)
    yield namespace, runner
    runner.close()


def world(kube: KubeClient, ns: str) -> World | None:
    cm = kube.get_or_none(api_path("v1", "configmaps", ns, world_configmap_name("elastic")))
    text = ((cm or {}).get("data") or {}).get("world.json")
    return parse_world(text) if text else None


def world_where(kube: KubeClient, ns: str, size: int | None = None, after: int = 0
                ) -> World | None:
    """The current world when it has ``size`` members and an epoch above ``after``."""
    current = world(kube, ns)
    if current is None or current.epoch <= after or size not in (None, current.size):
        return None
    return current


def trained_at(runner: HostThread, epoch: int, pods: list[str]) -> bool:
    """Every pod in ``pods`` formed its group in world ``epoch`` and stepped on."""
    ready = runner.log_lines(rf" world_ready .*epoch={epoch}\b")
    return all(any(line.startswith(f"{p} ") for line in ready) for p in pods)


def test_deleted_pod_survivors_rebuild_and_scale_up_joins(
    kube: KubeClient, job: tuple[str, HostThread]
) -> None:
    ns, runner = job
    first = wait_for(lambda: world_where(kube, ns, 3), "the first world", timeout=120)
    wait_for(lambda: trained_at(runner, first.epoch, [m.pod for m in first.members]),
             "every member to join epoch 1", timeout=180)
    wait_for(lambda: runner.log_lines(r" epoch_done "), "a finished data epoch",
             timeout=180)

    victim = first.members[-1].pod
    kube.delete(api_path("v1", "pods", ns, victim), grace=0)
    after = wait_for(lambda: world_where(kube, ns, after=first.epoch), "a new epoch",
                     timeout=60)
    survivors = [m.pod for m in first.members if m.pod != victim]
    wait_for(lambda: trained_at(runner, after.epoch, survivors),
             "survivors to rebuild the ring in the new epoch", timeout=180)
    # The processes stayed alive: each survivor logged exactly one process start.
    for pod in survivors:
        log = (runner.host.workdir / f"{pod}.log").read_text()
        assert log.count(" joined ") >= 2, pod

    kube.merge_patch(tj_path(ns, "elastic", "scale"), {"spec": {"replicas": 4}})
    grown = wait_for(lambda: world_where(kube, ns, 4), "a world of four", timeout=120)
    wait_for(lambda: trained_at(runner, grown.epoch, [m.pod for m in grown.members]),
             "the newcomer to join and everyone to rebuild", timeout=180)
    assert runner.log_lines(r" lr_rescale ")
    status: dict[str, Any] = get_status(kube, ns, "elastic")
    assert status["phase"] == "Running"
    assert status["world"]["size"] == 4
    groups = runner.log_lines(r" group_formed ")
    assert groups and all(f"backend={request_backend(kube, ns)}" in line for line in groups)


def request_backend(kube: KubeClient, ns: str) -> str:
    """The collective library the job asked for (``torch`` runs gloo on CPU)."""
    backend: str = kube.get(tj_path(ns, "elastic"))["spec"]["backend"]
    return "gloo" if backend == "torch" else backend
