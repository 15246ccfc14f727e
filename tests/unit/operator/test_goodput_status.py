"""Goodput and the checkpoint interval in the job's status, from the members' stats;
the goodput as a Prometheus metric; stats read from the reports ConfigMap."""

from __future__ import annotations

from typing import Any

import pytest

from ringwright.objects import Obj
from ringwright.operator.api.models import GoodputStatus
from ringwright.operator.api.schedulingpolicy import SchedulingPolicySpec
from ringwright.operator.metrics import OperatorMetrics
from ringwright.operator.observe.job import _reports, _stats
from ringwright.operator.plan.health.goodput import checkpoint_interval, goodput
from ringwright.operator.plan.isolation import honest_stats
from ringwright.operator.plan.reconcile import Observed, plan
from ringwright.report_seal import seal_stats
from ringwright.world import MemberStats, Report, ReportKind, stats_key
from tests.unit.operator.test_reconcile import NODES, NOW, SETTINGS, FakePlacer, job, pod, world_of


def stats(since: float = 1.0, generation: int = 1, **seconds: float) -> MemberStats:
    return MemberStats.model_validate({"generation": generation, "at": 5.0, "since": since,
                                       "seconds": seconds})


def test_goodput_adds_only_what_grew_and_keeps_the_time_of_pods_gone() -> None:
    first = goodput({"a": stats(training=80, reforming=20), "b": stats(training=90,
                                                                      detecting=10)}, None)
    assert first is not None
    assert first.seconds == {"training": 170, "reforming": 20, "detecting": 10}
    assert first.training == pytest.approx(0.85)
    # a grew; b is gone (its time stays counted); c is a new pod.
    second = goodput({"a": stats(training=100, reforming=20), "c": stats(since=9, syncing=4,
                                                                         training=16)}, first)
    assert second is not None
    assert second.seconds == {"training": 206, "reforming": 20, "detecting": 10, "syncing": 4}
    assert set(second.members) == {"a", "c"}
    assert second.training + second.detecting + second.reforming + second.syncing \
        + second.replaying == pytest.approx(1.0, abs=1e-3)


def test_a_new_process_under_the_same_pod_name_counts_from_zero() -> None:
    first = goodput({"a": stats(since=1, training=100)}, None)
    again = goodput({"a": stats(since=2, training=30, reforming=5)}, first)
    assert again is not None and again.seconds == {"training": 130, "reforming": 5}
    assert goodput({}, None) is None


def test_the_checkpoint_interval_is_the_writers_in_the_current_world() -> None:
    world = world_of([0, 1])
    writer = MemberStats.model_validate({"generation": 1, "at": 1.0,
                                         "checkpointIntervalSteps": 240,
                                         "checkpointWriteSeconds": 2.0, "mtbfSeconds": 3600.0})
    found = checkpoint_interval({"tj-worker-0": writer}, world, True)
    assert found is not None
    assert (found.steps, found.auto, found.write_seconds, found.mtbf_seconds) == (
        240, True, 2.0, 3600.0)
    assert checkpoint_interval({"tj-worker-1": writer}, world, True) is None, "not the writer"
    assert checkpoint_interval({"tj-worker-0": writer}, world_of([0, 1], 2), True) is None


def run_round(stats_by_pod: dict[str, MemberStats], status: Obj | None = None) -> Any:
    body = job(replicas=2, status=status or {"phase": "Running"},
               checkpoint={"path": "/ckpt", "intervalSteps": "Auto"})
    observed = Observed(job=body, pods=[pod(0), pod(1)], world=world_of([0, 1]), reports={},
                        policy=SchedulingPolicySpec(), inventory=NODES, stats=stats_by_pod)
    return plan(observed, SETTINGS, NOW, FakePlacer())


def test_a_round_writes_goodput_and_interval_into_the_status_and_the_metric() -> None:
    writer = MemberStats.model_validate({
        "generation": 1, "at": 1.0, "since": 1.0, "checkpointIntervalSteps": 120,
        "seconds": {"training": 90.0, "syncing": 10.0}})
    result = run_round({"tj-worker-0": writer, "tj-worker-1": stats(training=100.0)})
    assert result.status["checkpointInterval"] == {"steps": 120, "auto": True}
    assert result.status["goodput"]["training"] == pytest.approx(0.95)
    assert result.status["goodput"]["syncing"] == pytest.approx(0.05)
    GoodputStatus.model_validate(result.status["goodput"])
    metrics = OperatorMetrics()
    observed = Observed(job=job(), pods=[], world=None, reports={}, policy=None,
                        inventory=NODES)
    metrics.applied("ns", "tj", observed, result)
    value = metrics.registry.get_sample_value(
        "ringwright_operator_job_goodput_ratio", {"namespace": "ns", "job_name": "tj",
                                                  "phase": "training"})
    assert value == pytest.approx(0.95)
    metrics.forget("ns", "tj")
    assert metrics.registry.get_sample_value(
        "ringwright_operator_job_goodput_ratio", {"namespace": "ns", "job_name": "tj",
                                                  "phase": "training"}) is None


def test_stats_sit_beside_reports_and_only_the_pods_own_count() -> None:
    key_pod = pod(0)
    key_pod["spec"]["containers"] = [{"name": "t", "env": [
        {"name": "RINGWRIGHT_REPORT_KEY", "value": "k0"}]}]
    cm = {"data": {
        "tj-worker-0": Report(kind=ReportKind.STALLED, generation=1, at=1.0).to_json(),
        stats_key("tj-worker-0"): seal_stats("tj-worker-0", stats(training=5), "k0").to_json(),
        stats_key("tj-worker-9"): stats(training=7).to_json(),
    }}
    assert set(_reports(cm)) == {"tj-worker-0"}
    read = _stats(cm)
    assert set(read) == {"tj-worker-0", "tj-worker-9"}
    forged = {"tj-worker-0": stats(training=1e6)}
    assert honest_stats(forged, [key_pod]) == {}
    assert set(honest_stats(read, [key_pod])) == {"tj-worker-0", "tj-worker-9"}
