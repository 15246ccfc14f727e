"""Scaffold drift on the real API server: a deleted Service, an edited Service and a deleted
or relabelled reports ConfigMap come back within a round or two, from the watch cache's
view of them, not from the periodic full re-apply (set to an hour here)."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ringwright.devcluster.control_plane import Cluster
from ringwright.kube import KubeClient, api_path
from ringwright.objects import Obj
from ringwright.operator.plan.manifests import JOB_LABEL
from tests.cluster.test_operator import wait_world
from tests.jobs import OperatorProcess, instead_of, tj_path, training_job
from tests.waiting import wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture()
def hourly_scaffold(operator: OperatorProcess, cluster: Cluster, namespace: str,
                    tmp_path: Path) -> Iterator[OperatorProcess]:
    """An operator of the test's own whose full scaffold re-apply is an hour away. It
    watches the test's namespace only: its rounds are then this job's, not those of
    earlier tests' jobs still going away with their namespaces."""
    own = OperatorProcess(cluster, tmp_path / "operator.log", args=["--namespace", namespace],
                          settings={**operator.settings,
                                    "RINGWRIGHT_SCAFFOLD_RESYNC_SECONDS": "3600"})
    with instead_of(operator, own):
        yield own


def rounds(op: OperatorProcess) -> float:
    text = urllib.request.urlopen(op.metrics_url).read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "ringwright_operator_reconcile_seconds":
            return next(s.value for s in family.samples if s.name.endswith("_count"))
    raise AssertionError("the operator exports no reconcile rounds")


def repaired(kube: KubeClient, path: str, op: OperatorProcess,
             good: Callable[[Obj], bool], what: str) -> float:
    """Wait until the object at ``path`` is back as the operator wants it; rounds taken."""
    before = rounds(op)
    wait_for(lambda: (obj := kube.get_or_none(path)) is not None and good(obj),
             f"{what} repaired", timeout=30)
    return rounds(op) - before


def labelled(obj: Obj) -> bool:
    return bool((obj["metadata"].get("labels") or {}).get(JOB_LABEL) == "drift")


def test_deleted_and_edited_scaffold_objects_are_repaired_within_a_round_or_two(
    kube: KubeClient, namespace: str, hourly_scaffold: OperatorProcess,
) -> None:
    op = hourly_scaffold
    kube.create(tj_path(namespace), training_job("drift", replicas=2, minimum=1))
    wait_world(kube, namespace, "drift", 2)
    service = api_path("v1", "services", namespace, "drift")
    reports = api_path("v1", "configmaps", namespace, "drift-reports")
    taken: dict[str, float] = {}
    try:
        gone = kube.get(service)["metadata"]["uid"]
        kube.delete(service)
        taken["Service deleted"] = repaired(
            kube, service, op, lambda o: bool(o["metadata"]["uid"] != gone), "deleted Service")
        kube.merge_patch(service, {"spec": {"publishNotReadyAddresses": False}})
        taken["Service edited"] = repaired(
            kube, service, op, lambda o: bool(o["spec"].get("publishNotReadyAddresses")),
            "edited Service")
        kube.delete(reports)
        taken["reports deleted"] = repaired(kube, reports, op, labelled, "deleted reports")
        # Without its label the ConfigMap leaves the operator's (label-selected) watch.
        kube.merge_patch(reports, {"metadata": {"labels": {JOB_LABEL: None}}})
        taken["reports unlabelled"] = repaired(kube, reports, op, labelled,
                                               "unlabelled reports")
        assert all(n <= 3 for n in taken.values()), f"rounds per repair: {taken}"
    except AssertionError as err:
        raise AssertionError(f"{err}\n{op.tail(30)}") from err
