"""The join rule: a newcomer enters a world only once it said it is ready to take part."""

from __future__ import annotations

from ringwright.joining import ready_to_join
from ringwright.world import JobRef, Member, Report, ReportKind, StoreAddress, World


def world(pods: list[str], generation: int = 3) -> World:
    members = tuple(Member(rank=i, pod=p, ip=f"127.0.0.{10 + i}") for i, p in enumerate(pods))
    return World(job=JobRef(namespace="n", name="j"), generation=generation, members=members,
                 store=StoreAddress(address="127.0.0.10"))


def report(kind: ReportKind, generation: int) -> Report:
    return Report(kind=kind, generation=generation, at=0.0)


def test_before_the_first_world_every_pod_may_enter() -> None:
    assert ready_to_join(None, {}, ["w0", "w1"]) == ["w0", "w1"]


def test_a_newcomer_enters_once_it_reported_joining_for_the_current_generation() -> None:
    current = world(["w0", "w1"])
    assert ready_to_join(current, {}, ["w0", "w2"]) == ["w0"]
    ready = {"w2": report(ReportKind.JOINING, 3)}
    assert ready_to_join(current, ready, ["w0", "w1", "w2"]) == ["w0", "w1", "w2"]


def test_an_announcement_for_an_older_world_is_stale() -> None:
    # Written before a newer world went out: by a process that has joined since, or died.
    assert ready_to_join(world(["w0"]), {"w2": report(ReportKind.JOINING, 2)}, ["w2"]) == []


def test_other_reports_are_no_announcement() -> None:
    reports = {"w2": report(ReportKind.NO_STATE, 3), "w3": report(ReportKind.LEFT, 3)}
    assert ready_to_join(world(["w0"]), reports, ["w2", "w3"]) == []
