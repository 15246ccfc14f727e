"""One version of overlap for the generation's former name, ``epoch``: documents that
carry only ``epoch`` (written one version older) are read, and everything written also
carries ``epoch`` with the same value (for readers one version older)."""

from __future__ import annotations

import hashlib
import hmac
import json

from ringwright.operator.api.models import TrainingJobStatus
from ringwright.operator.plan.generations import (
    GENERATION_ANNOTATION,
    LEGACY_GENERATION_ANNOTATION,
    annotated_generation,
)
from ringwright.report_seal import seal, written_by
from ringwright.world import (
    JobRef,
    Report,
    ReportKind,
    StoreAddress,
    World,
    parse_report,
    parse_world,
)

OLD_WORLD = ('{"schemaVersion":1,"job":{"namespace":"ns","name":"j"},"epoch":7,'
             '"store":{"address":"127.0.0.1"},"members":[{"rank":0,"pod":"w-0","ip":"127.0.0.1"}]}')
OLD_REPORT = '{"at":1.0,"detail":"","epoch":5,"kind":"peer-dead","mac":"","suspects":["w-3"]}'
"""A report as one version older serializes it (sorted keys, no ``generation``)."""


def _hmac(key: str, pod: str, body: str) -> str:
    return hmac.new(key.encode(), pod.encode() + b"\0" + body.encode(), hashlib.sha256).hexdigest()


def test_a_world_of_one_version_older_is_read() -> None:
    assert parse_world(OLD_WORLD).generation == 7


def test_a_written_world_carries_the_generation_under_both_names() -> None:
    world = World(job=JobRef(namespace="ns", name="j"), generation=3, members=(),
                  store=StoreAddress(address="127.0.0.1"))
    doc = json.loads(world.to_json())
    assert (doc["generation"], doc["epoch"]) == (3, 3)
    assert parse_world(world.to_json()) == world


def test_a_report_of_one_version_older_is_read_and_its_seal_holds() -> None:
    assert parse_report(OLD_REPORT).generation == 5
    sealed = json.loads(OLD_REPORT) | {"mac": _hmac("key-0", "w-0", OLD_REPORT)}
    assert written_by("w-0", parse_report(json.dumps(sealed)), "key-0")


def test_a_written_report_carries_both_names_and_a_seal_one_version_older_verifies() -> None:
    report = seal("w-0", Report(kind=ReportKind.PEER_DEAD, generation=5, at=1.0,
                                suspects=("w-3",)), "key-0")
    doc = json.loads(report.to_json())
    assert (doc["generation"], doc["epoch"]) == (5, 5)
    # An older operator ignores the key it does not know and checks the rest.
    older = {k: v for k, v in doc.items() if k != "generation"} | {"mac": ""}
    older_body = json.dumps(older, sort_keys=True, separators=(",", ":"))
    assert older_body == OLD_REPORT
    assert hmac.compare_digest(doc["mac"], _hmac("key-0", "w-0", older_body))


def test_a_status_of_one_version_older_is_read() -> None:
    status = TrainingJobStatus.model_validate({"world": {"epoch": 4, "size": 2}})
    assert status.world.generation == 4


def test_the_written_status_carries_the_generation_under_both_names() -> None:
    status = TrainingJobStatus.model_validate({"world": {"generation": 4, "epoch": 4}})
    bumped = status.model_copy(
        update={"world": status.world.model_copy(update={"generation": 5})})
    world = bumped.to_wire()["world"]
    assert (world["generation"], world["epoch"]) == (5, 5)


def test_the_annotation_of_one_version_older_is_read() -> None:
    old = {"metadata": {"annotations": {LEGACY_GENERATION_ANNOTATION: "9"}}}
    assert annotated_generation(old) == 9
    # Both present: the higher one (each is a generation someone may have seen).
    both = {"metadata": {"annotations": {LEGACY_GENERATION_ANNOTATION: "9",
                                         GENERATION_ANNOTATION: "11"}}}
    assert annotated_generation(both) == 11

