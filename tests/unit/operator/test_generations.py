"""The generation rule: the next world is numbered above every generation seen anywhere, and is
written over the ConfigMap version it was decided from."""

from __future__ import annotations

import pytest

from ringwright.objects import Obj
from ringwright.operator.api.schedulingpolicy import SchedulingPolicySpec
from ringwright.operator.observe.cache import Written
from ringwright.operator.plan.generations import (
    GENERATION_ANNOTATION,
    LEGACY_GENERATION_ANNOTATION,
    GenerationsSeen,
    annotated_generation,
    next_generation,
)
from ringwright.operator.plan.manifests import PUBLISHED_ANNOTATION, published_at, world_configmap
from ringwright.operator.plan.reconcile import Observed, Plan, plan
from ringwright.world import Report, ReportKind
from tests.unit.operator.test_reconcile import NODES, NOW, SETTINGS, FakePlacer, job, pod, world_of


@pytest.mark.parametrize(("seen", "expected"), [
    (GenerationsSeen(), 1),  # a new job
    (GenerationsSeen(document=4, annotation=4, status=4), 5),  # the usual case
    (GenerationsSeen(document=0, annotation=7, status=5), 8),  # document corrupted
    (GenerationsSeen(document=0, annotation=0, status=9), 10),  # ConfigMap deleted
    (GenerationsSeen(document=3, annotation=3, status=6), 7),  # someone wrote an older world
    (GenerationsSeen(document=12, annotation=2, status=5), 13),  # another writer went ahead
])
def test_next_generation_is_above_everything_seen(seen: GenerationsSeen, expected: int) -> None:
    assert next_generation(seen) == expected


@pytest.mark.parametrize(("annotations", "expected"), [
    (None, 0), ({}, 0), ({GENERATION_ANNOTATION: "6"}, 6), ({GENERATION_ANNOTATION: "x"}, 0),
    ({GENERATION_ANNOTATION: "-3"}, 0),
])
def test_the_annotation_is_read_defensively(annotations: dict[str, str] | None,
                                            expected: int) -> None:
    cm: Obj = {"metadata": {"name": "tj-world"}}
    if annotations is not None:
        cm["metadata"]["annotations"] = annotations
    assert annotated_generation(cm) == expected
    assert annotated_generation(None) == 0


def test_the_world_configmap_carries_its_generation_as_an_annotation() -> None:
    cm = world_configmap(job(), "{}", 42, 1_700_000_000.25)
    # Also under the legacy name, for an operator one version older; and when it was written.
    assert cm["metadata"]["annotations"] == {GENERATION_ANNOTATION: "42",
                                             LEGACY_GENERATION_ANNOTATION: "42",
                                             PUBLISHED_ANNOTATION: "1700000000.250"}
    assert published_at(cm) == 1_700_000_000.25
    assert published_at(None) is None
    cm["metadata"]["annotations"][PUBLISHED_ANNOTATION] = "yesterday"
    assert published_at(cm) is None


def _plan(world_generation: int | None, annotation: int, status: Obj, version: str) -> Plan:
    body = job(status=status)
    world = world_of([0, 1, 2], generation=world_generation) if world_generation else None
    # Worker 3 asks to join the world read, so a world with it goes out.
    reports = {"tj-worker-3": Report(kind=ReportKind.JOINING, generation=world_generation,
                                     at=NOW)} if world_generation else {}
    observed = Observed(job=body, pods=[pod(i) for i in range(4)], world=world, reports=reports,
                        policy=SchedulingPolicySpec(), inventory=NODES,
                        world_annotation_generation=annotation, world_version=version)
    return plan(observed, SETTINGS, NOW, FakePlacer())


def test_a_corrupted_world_is_replaced_above_its_annotation_and_the_status() -> None:
    decided = _plan(None, 7, {"phase": "Running", "world": {"generation": 5}}, "881")
    assert decided.world is not None and decided.world.generation == 8
    assert decided.world_version == "881"
    assert decided.status["world"]["generation"] == 8


def test_a_deleted_world_is_recreated_above_the_status_and_only_if_still_absent() -> None:
    decided = _plan(None, 0, {"phase": "Running", "world": {"generation": 9}}, "")
    assert decided.world is not None
    assert decided.world.generation == 10
    assert decided.world_version == ""


def test_a_world_behind_the_status_does_not_pull_the_generation_back() -> None:
    decided = _plan(3, 3, {"phase": "Running", "world": {"generation": 6}}, "12")
    assert decided.world is not None
    assert decided.world.generation == 7
    assert decided.world_version == "12"


def _cm(version: str) -> Obj:
    return {"metadata": {"name": "tj-world", "namespace": "ns", "resourceVersion": version}}


def test_our_own_write_echoed_by_the_watch_is_not_news() -> None:
    written = Written()
    written.put("ConfigMap", _cm("10"))
    assert not written.outdated_by("ConfigMap", _cm("10"), deleted=False)
    assert not written.outdated_by("ConfigMap", _cm("9"), deleted=False)
    assert written.outdated_by("ConfigMap", _cm("11"), deleted=False)  # someone else's
    assert written.get("ConfigMap", "ns", "tj-world") is not None


def test_a_deletion_drops_our_copy_so_it_cannot_stand_in_for_the_object() -> None:
    written = Written()
    written.put("ConfigMap", _cm("10"))
    assert written.outdated_by("ConfigMap", _cm("15"), deleted=True)
    assert written.get("ConfigMap", "ns", "tj-world") is None
    # A write of ours newer than the deletion (it was re-created) stays.
    written.put("ConfigMap", _cm("20"))
    assert not written.outdated_by("ConfigMap", _cm("15"), deleted=True)
    assert written.get("ConfigMap", "ns", "tj-world") is not None


def test_a_world_whose_status_write_was_lost_is_mirrored_without_a_new_generation() -> None:
    """The world went out, then the operator died before writing the status."""
    observed = Observed(job=job(status={"phase": "Pending"}),
                        pods=[pod(i) for i in range(4)], world=world_of([0, 1, 2, 3], generation=3),
                        reports={}, policy=SchedulingPolicySpec(), inventory=NODES,
                        world_annotation_generation=3, world_version="40")
    decided = plan(observed, SETTINGS, NOW, FakePlacer())
    assert decided.world is None  # the pods already follow generation 3
    assert decided.status["phase"] == "Running"
    assert decided.status["world"]["generation"] == 3 and decided.status["world"]["size"] == 4
