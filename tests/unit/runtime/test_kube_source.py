"""The Kubernetes membership source and reporter against a fake that speaks the watch
protocol (list + resourceVersion, chunked watch streams, 410 Gone, merge patch)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from ringwright.kube import KubeClient, KubeConfig
from ringwright.report_seal import stats_written_by
from ringwright.runtime.membership.kube_source import KubeMembershipSource
from ringwright.runtime.membership.reporter import KubeReporter
from ringwright.runtime.membership.source import WorldTimeout
from ringwright.world import (
    WORLD_KEY,
    JobRef,
    Member,
    MemberStats,
    ReportKind,
    StoreAddress,
    World,
    parse_report,
    parse_stats,
    stats_key,
)
from tests.unit.runtime.kube_api_fake import FakeKubeApi

NS = "team-a"
TOKEN = "sa-token"
CM = "job-world"
WAIT = 10.0


def world(generation: int, size: int = 2) -> World:
    members = tuple(Member(rank=i, pod=f"job-worker-{i}", ip=f"10.0.0.{i + 1}")
                    for i in range(size))
    return World(job=JobRef(namespace=NS, name="job"), generation=generation, members=members,
                 store=StoreAddress(address="10.0.0.1"))


@pytest.fixture()
def api() -> Iterator[FakeKubeApi]:
    with FakeKubeApi(NS, TOKEN) as fake:
        yield fake


def clients(api: FakeKubeApi, token: str = TOKEN) -> Callable[[], KubeClient]:
    return lambda: KubeClient(KubeConfig(server=api.url, token=token), timeout=5)


def publish(api: FakeKubeApi, w: World) -> None:
    api.put_configmap(CM, {WORLD_KEY: w.to_json()})


@pytest.fixture()
def source(api: FakeKubeApi) -> Iterator[KubeMembershipSource]:
    src = KubeMembershipSource(clients(api), NS, CM, initial_backoff_s=0.05,
                               max_backoff_s=0.2)
    yield src
    src.close()


def eventually(probe: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not probe():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_first_world_comes_from_the_list(api: FakeKubeApi) -> None:
    publish(api, world(0))
    src = KubeMembershipSource(clients(api), NS, CM)
    try:
        assert src.wait_for_world(-1, WAIT).generation == 0
    finally:
        src.close()
    lists = [r for r in api.requests if r.method == "GET" and "watch" not in r.query]
    assert lists[0].query["fieldSelector"] == f"metadata.name={CM}"


def test_new_generations_arrive_through_one_watch_from_the_list_version(
        api: FakeKubeApi, source: KubeMembershipSource) -> None:
    eventually(lambda: len(api.watches()) == 1, "the watch to start")
    publish(api, world(0))
    publish(api, world(1, size=3))
    got = source.wait_for_world(0, WAIT)
    assert (got.generation, got.size) == (1, 3)
    watch = api.watches()[0]
    assert watch.query["resourceVersion"] == "100"
    assert watch.query["fieldSelector"] == f"metadata.name={CM}"
    assert len(api.watches()) == 1


def test_a_watch_ended_by_the_server_resumes_from_the_last_version(api: FakeKubeApi) -> None:
    publish(api, world(0))
    src = KubeMembershipSource(clients(api), NS, CM, watch_timeout_s=1)
    try:
        src.wait_for_world(-1, WAIT)
        eventually(lambda: len(api.watches()) >= 2, "a second watch after the timeout")
        seen = api.configmap(CM)
        assert seen is not None
        assert api.watches()[1].query["resourceVersion"] == seen["metadata"]["resourceVersion"]
        publish(api, world(1))
        assert src.wait_for_world(0, WAIT).generation == 1
    finally:
        src.close()


def test_an_expired_version_makes_it_list_again(
        api: FakeKubeApi, source: KubeMembershipSource) -> None:
    publish(api, world(0))
    source.wait_for_world(-1, WAIT)
    lists_before = sum(1 for r in api.requests if "watch" not in r.query)
    api.compact()
    api.cut_watches()
    publish(api, world(1))
    assert source.wait_for_world(0, WAIT).generation == 1
    assert sum(1 for r in api.requests if "watch" not in r.query) > lists_before


def test_a_dropped_connection_reconnects(api: FakeKubeApi, source: KubeMembershipSource) -> None:
    publish(api, world(0))
    source.wait_for_world(-1, WAIT)
    eventually(lambda: len(api.watches()) >= 1, "the watch to start")
    api.cut_watches()
    publish(api, world(1))
    assert source.wait_for_world(0, WAIT).generation == 1


def test_an_unreadable_world_keeps_the_last_good_one(
        api: FakeKubeApi, source: KubeMembershipSource) -> None:
    publish(api, world(4))
    source.wait_for_world(-1, WAIT)
    api.put_configmap(CM, {WORLD_KEY: '{"schemaVersion": 99}'})
    publish(api, world(3))
    publish(api, world(5))
    assert source.wait_for_world(4, WAIT).generation == 5
    assert source.latest() is not None


def test_without_a_valid_token_no_world_arrives(api: FakeKubeApi) -> None:
    publish(api, world(0))
    src = KubeMembershipSource(clients(api, token="wrong"), NS, CM, initial_backoff_s=0.05)
    try:
        with pytest.raises(WorldTimeout):
            src.wait_for_world(-1, 0.5)
        # It keeps retrying (waited for, not timed: a loaded machine may be slow).
        deadline = time.monotonic() + 30
        while len(api.requests) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        src.close()
    assert len(api.requests) >= 2, "it keeps retrying"


def test_reports_merge_patch_only_the_pods_own_key(api: FakeKubeApi) -> None:
    api.put_configmap("job-reports", {"other-pod": "{}"})
    reporter = KubeReporter(clients(api), NS, "job-reports", "job-worker-1",
                            wall_clock=lambda: 1700000000.0)
    reporter.report(ReportKind.COLLECTIVE_FAILED, 3, "peer gone")
    reporter.close()
    data = (api.configmap("job-reports") or {})["data"]
    assert data["other-pod"] == "{}"
    report = parse_report(data["job-worker-1"])
    assert (report.kind, report.generation, report.detail) == (ReportKind.COLLECTIVE_FAILED, 3,
                                                          "peer gone")
    patch = next(r for r in api.requests if r.method == "PATCH")
    assert set((patch.body or {})["data"]) == {"job-worker-1"}


def test_stats_go_beside_the_report_sealed_with_the_pods_key(api: FakeKubeApi) -> None:
    api.put_configmap("job-reports", {})
    reporter = KubeReporter(clients(api), NS, "job-reports", "job-worker-1", key="k1")
    reporter.report(ReportKind.STALLED, 2)
    reporter.stats(MemberStats(generation=2, at=1.0, stepSeconds=0.5))
    reporter.close()
    data = (api.configmap("job-reports") or {})["data"]
    assert parse_report(data["job-worker-1"]).kind == ReportKind.STALLED, \
        "the stats did not replace the report"
    stats = parse_stats(data[stats_key("job-worker-1")])
    assert stats.step_seconds == 0.5
    assert stats_written_by("job-worker-1", stats, "k1")
    assert not stats_written_by("job-worker-0", stats, "k1")


def test_a_report_that_cannot_be_delivered_is_dropped(api: FakeKubeApi) -> None:
    reporter = KubeReporter(clients(api), NS, "late-reports", "job-worker-1")
    reporter.report(ReportKind.STALLED, 0)
    eventually(lambda: any(r.method == "PATCH" for r in api.requests),
               "the first delivery attempt")
    # Refused (no such ConfigMap yet) and dropped; the reporter still delivers the next.
    api.put_configmap("late-reports", {})
    reporter.report(ReportKind.COLLECTIVE_FAILED, 1, "peer gone")
    reporter.close()
    patches = [r for r in api.requests if r.method == "PATCH"]
    assert len(patches) == 2, "the refused report is not retried"
    data = (api.configmap("late-reports") or {})["data"]
    report = parse_report(data["job-worker-1"])
    assert (report.kind, report.generation) == (ReportKind.COLLECTIVE_FAILED, 1)
