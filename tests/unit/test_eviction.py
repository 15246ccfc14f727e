"""The shared eviction rule: peers' reports are corroborated before anyone is dropped."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from ringwright.eviction import all_waiting, judge, needs_new_generation
from ringwright.world import JobRef, Member, Report, ReportKind, StoreAddress, World


def world(size: int, generation: int = 3) -> World:
    members = tuple(Member(rank=i, pod=f"w{i}", ip=f"127.0.0.{10 + i}") for i in range(size))
    return World(job=JobRef(namespace="n", name="j"), generation=generation, members=members,
                 store=StoreAddress(address="127.0.0.10"))


def dead(generation: int, *suspects: str) -> Report:
    return Report(kind=ReportKind.PEER_DEAD, generation=generation, at=0.0, suspects=suspects)


@dataclass
class Case:
    name: str
    size: int
    reports: dict[str, Report]
    evicted: list[str]
    own_view: set[str] = field(default_factory=set)


CASES = [
    Case("one member dead, everyone says so", 4,
         {"w0": dead(3, "w2"), "w1": dead(3, "w2"), "w3": dead(3, "w2")}, ["w2"]),
    Case("a single accuser is not enough", 4, {"w0": dead(3, "w2")}, []),
    Case("a single accuser and the judge's own view", 4, {"w0": dead(3, "w2")}, ["w2"],
         {"w2"}),
    Case("the judge's view alone is not a report", 4, {}, [], {"w2"}),
    Case("a cut-off member names everyone; the others name it", 4,
         {"w3": dead(3, "w0", "w1", "w2"), "w0": dead(3, "w3"), "w1": dead(3, "w3"),
          "w2": dead(3, "w3")}, ["w3"]),
    Case("a cut-off member alone accusing loses", 4, {"w3": dead(3, "w0", "w1", "w2")}, []),
    Case("two dead at once", 4,
         {"w0": dead(3, "w1", "w3"), "w2": dead(3, "w1", "w3")}, ["w1", "w3"]),
    Case("a 2|2 split keeps the half with rank 0", 4,
         {"w0": dead(3, "w2", "w3"), "w1": dead(3, "w2", "w3"),
          "w2": dead(3, "w0", "w1"), "w3": dead(3, "w0", "w1")}, ["w2", "w3"]),
    Case("a world of two: the higher rank goes when both accuse", 2,
         {"w0": dead(3, "w1"), "w1": dead(3, "w0")}, ["w1"]),
    Case("a world of two: one accuser suffices", 2, {"w1": dead(3, "w0")}, ["w0"]),
    Case("reports of an older generation are ignored", 4,
         {"w0": dead(2, "w2"), "w1": dead(2, "w2")}, []),
    Case("non-members neither vote nor get evicted", 4,
         {"x": dead(3, "w2"), "w0": dead(3, "w2", "y")}, []),
    Case("nobody votes for itself", 4, {"w2": dead(3, "w2"), "w0": dead(3, "w2")}, []),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_judge(case: Case) -> None:
    out = judge(world(case.size), case.reports, case.own_view)
    assert [e.pod for e in out] == case.evicted
    for e in out:
        assert e.reporters and e.pod not in e.reporters and e.reason


def report(kind: ReportKind, generation: int = 3, at: float = 100.0, *suspects: str) -> Report:
    return Report(kind=kind, generation=generation, at=at, suspects=suspects)


@pytest.mark.parametrize(("reports", "now", "bump"), [
    ({}, 200.0, False),
    ({"w1": report(ReportKind.NO_STATE)}, 100.0, True),
    ({"w1": report(ReportKind.NO_STATE, 2)}, 100.0, False),
    ({"x": report(ReportKind.NO_STATE)}, 100.0, False),
    ({"w1": report(ReportKind.COLLECTIVE_FAILED)}, 101.0, False),
    ({"w1": report(ReportKind.COLLECTIVE_FAILED)}, 104.0, True),
    ({"w1": report(ReportKind.COLLECTIVE_FAILED, 3, 100.0, "w2")}, 104.0, False),
    ({"w1": report(ReportKind.STALLED)}, 104.0, False),
], ids=["quiet", "no-state", "old-generation", "non-member", "verdict-pending", "no-verdict",
        "verdict-given", "stalled-is-evicted-elsewhere"])
def test_needs_new_generation(reports: dict[str, Report], now: float, bump: bool) -> None:
    assert (needs_new_generation(world(4), reports, now, verdict_wait_s=4.0) is not None) is bump


def test_the_next_world_is_due_at_once_when_every_survivor_waits_for_it() -> None:
    w = world(4)
    failed = Report(kind=ReportKind.COLLECTIVE_FAILED, generation=3, at=0.0)
    reports = {"w0": dead(3, "w2"), "w1": failed, "w3": dead(3, "w2")}
    assert all_waiting(w, reports, ["w0", "w1", "w3"])
    assert not all_waiting(w, {**reports, "w1": dead(2, "w2")}, ["w0", "w1", "w3"])
    assert not all_waiting(w, {k: v for k, v in reports.items() if k != "w1"},
                           ["w0", "w1", "w3"])  # w1 still trains
    stalled = Report(kind=ReportKind.STALLED, generation=3, at=0.0)
    assert not all_waiting(w, {**reports, "w1": stalled}, ["w0", "w1", "w3"])
    assert not all_waiting(w, {**reports, "x": failed}, ["w0", "w1", "w3", "x"])  # a newcomer
    assert not all_waiting(w, reports, [])
