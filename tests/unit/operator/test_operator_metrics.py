"""Operator metrics: what a plan did, counted once, and served in the text format."""

from __future__ import annotations

import urllib.request
from collections.abc import Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from ringwright.exposition import serve
from ringwright.objects import Obj
from ringwright.operator.api.schedulingpolicy import SchedulingPolicySpec
from ringwright.operator.metrics import LossCause, OperatorMetrics, effects
from ringwright.operator.plan.manifests import INDEX_LABEL, JOB_LABEL, ROLE_LABEL
from ringwright.operator.plan.placement.inventory import Inventory, NodeInfo
from ringwright.operator.plan.reconcile import Observed, Placement, Plan, plan
from ringwright.operator.settings import OperatorSettings
from ringwright.world import (
    DEFAULT_METRICS_PORT,
    Env,
    JobRef,
    Member,
    Report,
    ReportKind,
    StoreAddress,
    World,
)

NOW = 2_000_000.0
SETTINGS = OperatorSettings(settle_seconds=0, backoff_base_seconds=1)
NODES = Inventory(tuple(NodeInfo(name=f"n{i}", rack="r0", nvlink_domain="r0-nvl",
                                 gpu_model="H100") for i in range(2)))


def job(status: Obj | None = None, replicas: int = 3) -> Obj:
    return {"apiVersion": "ringwright.dev/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": "tj", "namespace": "ns", "uid": "uid-tj", "generation": 1},
            "spec": {"workers": {"min": 1, "replicas": replicas, "template": {
                "spec": {"containers": [{"name": "train", "image": "img"}]}}}},
            "status": status or {}}


def pod(i: int, phase: str = "Running") -> Obj:
    return {"metadata": {"name": f"tj-worker-{i}", "uid": f"u{i}", "labels": {
                JOB_LABEL: "tj", ROLE_LABEL: "worker", INDEX_LABEL: str(i)}},
            "spec": {"nodeName": "n0"},
            "status": {"phase": phase, "podIP": f"127.0.0.{i + 2}",
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def world(indices: Sequence[int], generation: int = 1) -> World:
    members = tuple(Member(rank=r, pod=f"tj-worker-{i}", pod_uid=f"u{i}", ip=f"127.0.0.{i + 2}")
                    for r, i in enumerate(indices))
    return World(job=JobRef(namespace="ns", name="tj"), generation=generation,
                 store=StoreAddress(address=members[0].ip), members=members)


def place_all(spec: Any, policy: Any, inventory: Any, live: Sequence[Any]) -> Placement:
    missing = spec.workers.replicas - sum(1 for p in live if p.role == "worker")
    return Placement(workers=[{} for _ in range(missing)], gpu_model="H100", summary="ok")


def place_none(spec: Any, policy: Any, inventory: Any, live: Sequence[Any]) -> Placement:
    return Placement(reason="InsufficientGPUs", message="no room")


def observed(body: Obj, pods: Sequence[Obj], w: World | None = None,
             reports: dict[str, Report] | None = None) -> Observed:
    return Observed(job=body, pods=pods, world=w, reports=reports or {},
                    policy=SchedulingPolicySpec(), inventory=NODES)


def round_(obs: Observed, now: float = NOW, placer: Any = place_all) -> Plan:
    return plan(obs, SETTINGS, now, placer)


def test_new_job_counts_created_pods_by_role_and_its_phase() -> None:
    obs = observed(job(), [])
    done = effects(obs, round_(obs))
    assert done.created == {"worker": 3}
    assert done.phase == "Pending" and not done.published and done.lost == []


def test_lost_members_are_counted_once_with_their_cause() -> None:
    running = {"phase": "Running", "restarts": 0}
    pods = [pod(0), pod(1, phase="Failed")]
    stalled = {"tj-worker-0": Report(kind=ReportKind.STALLED, generation=1, at=NOW)}
    obs = observed(job(running), pods, world([0, 1, 2]), stalled)
    first = round_(obs)
    done = effects(obs, first)
    assert sorted(done.lost) == sorted([LossCause.POD_GONE, LossCause.POD_FAILED,
                                        LossCause.STALLED])
    assert done.deleted == {"worker": 2}
    again = observed(job(first.status), pods, world([0, 1, 2]))
    assert effects(again, round_(again, NOW + 0.1)).lost == []


def test_placement_failure_counts_the_transition_not_every_round() -> None:
    obs = observed(job(), [])
    first = round_(obs, placer=place_none)
    assert effects(obs, first).unschedulable == "InsufficientGPUs"
    again = observed(job(first.status), [])
    assert effects(again, round_(again, NOW + 5, place_none)).unschedulable == ""


def test_published_world_is_a_generation() -> None:
    obs = observed(job({"phase": "Pending"}), [pod(i) for i in range(3)])
    decided = round_(obs)
    assert decided.world is not None
    assert effects(obs, decided).published


def samples(metrics: OperatorMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client import generate_latest

    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_counters_and_phase_gauge_follow_applied_plans() -> None:
    metrics = OperatorMetrics()
    running = {"phase": "Running", "restarts": 0}
    obs = observed(job(running, replicas=2), [pod(0), pod(1)], world([0, 1, 2]))
    with metrics.round():
        with metrics.planning():
            decided = round_(obs, NOW)
        metrics.applied("ns", "tj", obs, decided)
    metrics.api_error("PATCH", 409)
    got = samples(metrics)
    assert got[("ringwright_operator_members_lost_total", (("cause", "pod_gone"),))] == 1
    assert got[("ringwright_operator_world_generations_published_total", ())] == 1
    assert got[("ringwright_operator_jobs", (("phase", "Running"),))] == 1
    assert got[("ringwright_operator_api_errors_total", (("code", "409"), ("verb", "PATCH")))] == 1
    assert got[("ringwright_operator_reconcile_seconds_count", ())] == 1
    assert got[("ringwright_operator_planning_seconds_count", ())] == 1
    metrics.forget("ns", "tj")
    assert samples(metrics)[("ringwright_operator_jobs", (("phase", "Running"),))] == 0


def test_metrics_are_served_over_http() -> None:
    metrics = OperatorMetrics()
    metrics.api_error("GET", 500)
    endpoint = serve(metrics.registry, 0, "127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics") as resp:
            text = resp.read().decode()
    finally:
        endpoint.stop()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"ringwright_operator_api_errors", "ringwright_operator_reconcile_seconds",
            "ringwright_operator_jobs", "ringwright_operator_pods_created"} <= names


def test_training_pods_expose_the_runtime_metrics_port() -> None:
    obs = observed(job(), [])
    created = round_(obs).create[0]["spec"]["containers"][0]
    assert {"name": "metrics", "containerPort": DEFAULT_METRICS_PORT, "protocol": "TCP"} \
        in created["ports"]
    assert {"name": Env.METRICS_PORT, "value": str(DEFAULT_METRICS_PORT)} in created["env"]
