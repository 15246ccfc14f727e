"""Operator + real runtime processes on the local cluster: a worker slow for good is
replaced off its node, judged from the stats its peers and it send."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ringwright.devcluster.podhost import PodHost
from ringwright.kube import KubeClient, api_path
from ringwright.operator.api.base import API_VERSION
from ringwright.operator.api.schedulingpolicy import SchedulingPolicy
from ringwright.runtime.settings import SettingsEnv
from ringwright.world import World, parse_world, world_configmap_name
from tests.e2e.test_elastic_job import WORKER, HostThread
from tests.jobs import OperatorProcess, get_status, tj_path, training_job
from tests.waiting import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

SLOW = "straggle-worker-1"


@pytest.fixture
def policy(kube: KubeClient, namespace: str) -> Iterator[str]:
    name = f"stragglers-{namespace}"
    body = SchedulingPolicy.model_validate({"metadata": {"name": name}, "spec": {
        "stragglers": {"factor": 1.5, "windowSeconds": 10, "avoidSeconds": 600}}})
    path = api_path(API_VERSION, "schedulingpolicies")
    kube.create(path, body.to_wire())
    yield name
    kube.delete(api_path(API_VERSION, "schedulingpolicies", name=name))


@pytest.fixture
def runner(kube: KubeClient, namespace: str, operator: OperatorProcess, policy: str,
           tmp_path: Path) -> Iterator[HostThread]:
    kube.create(tj_path(namespace), training_job("straggle", replicas=3, minimum=2,
                                                 gpusPerWorker=0,
                                                 schedulingPolicyName=policy))
    env = {"TRACE_DIR": str(tmp_path / "pods" / "trace"), "EPOCHS": "400", "SAMPLES": "1024",
           "BATCH": "4", "COMMIT_EVERY": "5", "STEP_SLEEP": "0.05", "OMP_NUM_THREADS": "1",
           "SLOW_POD": SLOW, "SLOW_FACTOR": "3", SettingsEnv.STATS_INTERVAL: "1"}
    host = PodHost(kube, namespace, "straggle", [sys.executable, str(WORKER)],
                   tmp_path / "pods", extra_env=env, readiness_grace=120)
    runner = HostThread(host)
    yield runner
    runner.close()


def world(kube: KubeClient, namespace: str) -> World | None:
    cm = kube.get_or_none(api_path("v1", "configmaps", namespace,
                                   world_configmap_name("straggle")))
    text = ((cm or {}).get("data") or {}).get("world.json")
    return parse_world(text) if text else None


def events(kube: KubeClient, namespace: str, name: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = kube.list(api_path("v1", "events", namespace),
                                          fieldSelector=f"involvedObject.name={name}")
    return out


def node_of(kube: KubeClient, namespace: str, pod: str) -> str:
    found = kube.get_or_none(api_path("v1", "pods", namespace, pod)) or {}
    return str((found.get("spec") or {}).get("nodeName") or "")


def test_a_worker_slow_for_good_is_replaced_off_its_node(
        kube: KubeClient, namespace: str, runner: HostThread) -> None:
    slow_node = wait_for(lambda: node_of(kube, namespace, SLOW), f"{SLOW} bound", timeout=120)

    def full_without_it() -> Any:
        current = world(kube, namespace)
        if current is None or current.size != 3 or SLOW in current.pods:
            return None
        return current if {m.pod for m in current.members} <= runner.traces().trained(
            current.generation) else None

    try:
        new = wait_for(full_without_it, "a world of 3 without the straggler that trained",
                       timeout=300, interval=1.0)
    except AssertionError as err:
        pods = [(p["metadata"]["name"], (p.get("status") or {}).get("phase"),
                 (p.get("spec") or {}).get("nodeName"))
                for p in kube.list(api_path("v1", "pods", namespace))]
        current = world(kube, namespace)
        trained = runner.traces().trained(current.generation) if current else set()
        told = [(e["reason"], e["message"]) for e in events(kube, namespace, "straggle")]
        raise AssertionError(
            f"{err}\npods {pods}\nworld {current and current.pods} trained {trained}\n"
            f"events {told}\nstarts {dict(runner.host.starts)}\n{runner.tails(12)}") from None
    # The condition may be False again already (every member keeps pace): the event stays.
    [replaced] = wait_for(lambda: [e for e in events(kube, namespace, "straggle")
                                   if e["reason"] == "StragglerReplaced"],
                          "the StragglerReplaced event")
    assert replaced["type"] == "Warning"
    assert SLOW in replaced["message"] and slow_node in replaced["message"]
    status = get_status(kube, namespace, "straggle")
    assert [a["node"] for a in status["avoidedNodes"]] == [slow_node]
    [newcomer] = [m.pod for m in new.members if m.pod not in ("straggle-worker-0",
                                                              "straggle-worker-2")]
    assert node_of(kube, namespace, newcomer) != slow_node
