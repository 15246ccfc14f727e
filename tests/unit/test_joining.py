"""The join rule: a newcomer enters a world only once it said it is ready to take part."""

from __future__ import annotations

from ringwright.joining import ready_to_join
from ringwright.world import JobRef, Member, Report, ReportKind, StoreAddress, World


def world(pods: list[str], generation: int = 3) -> World:
    members = tuple(Member(rank=i, pod=p, pod_uid=f"uid-{p}", ip=f"127.0.0.{10 + i}")
                    for i, p in enumerate(pods))
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


def test_a_replacement_under_a_members_name_is_a_newcomer() -> None:
    # The pod was deleted and created again under its name: its process starts from
    # nothing, and the members would stop at their next commit to wait for it.
    current = world(["w0", "w1"])
    replaced = {"w0": "uid-w0", "w1": "uid-w1-again"}
    assert ready_to_join(current, {}, ["w0", "w1"], replaced) == ["w0"]
    asks = {"w1": report(ReportKind.JOINING, 3)}
    assert ready_to_join(current, asks, ["w0", "w1"], replaced) == ["w0", "w1"]
    # The same pod (its uid unchanged, or unknown) is the member it was.
    assert ready_to_join(current, {}, ["w0", "w1"], {"w1": "uid-w1"}) == ["w0", "w1"]
