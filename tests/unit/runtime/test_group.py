"""The group manager: which worlds it joins, when it leaves, whose state wins."""

from __future__ import annotations

import threading

import pytest

from ringwright.runtime.collectives.backend import (
    CollectiveError,
    RanksAbsent,
    RankTaken,
    Superseded,
)
from ringwright.runtime.collectives.group import (
    FENCED_EXIT,
    Fenced,
    GroupManager,
    LeftWorld,
    MemberInfo,
    WorldChanged,
    choose_source,
)
from ringwright.runtime.membership.health import StallWatchdog
from ringwright.runtime.membership.liveness import PeerFailure
from ringwright.runtime.membership.source import WorldTimeout
from ringwright.runtime.settings import RuntimeSettings
from ringwright.world import ReportKind, World
from tests.unit.runtime.runtime_fakes import FakeBackend, FakeReporter, FakeSource, make_world

ME = "w-1"


def info(pod: str, state_generation: int, state_rank: int, step: int = 0) -> MemberInfo:
    return MemberInfo(pod, state_generation, state_rank, step)


@pytest.mark.parametrize(
    ("infos", "expected"),
    [
        ([info("a", -1, -1), info("b", -1, -1)], None),
        ([info("new", -1, -1), info("s2", 4, 2), info("s1", 4, 1)], 2),
        # A member whose state is from an older world loses to the survivors of the newest.
        ([info("old", 2, 0), info("s3", 4, 3), info("s1", 4, 1)], 2),
        ([info("only", 0, 5)], 0),
    ],
    ids=["fresh-job", "lowest-survivor", "stale-member", "single"],
)
def test_choose_source(infos: list[MemberInfo], expected: int | None) -> None:
    assert choose_source(infos) == expected


def manager(source: FakeSource, backend: FakeBackend,
            reporter: FakeReporter | None = None) -> GroupManager:
    settings = RuntimeSettings(world_wait_timeout_s=5)
    return GroupManager(source, backend, ME, settings, reporter or FakeReporter(),
                        StallWatchdog(0))


def test_joins_with_its_rank_from_the_world() -> None:
    source, backend = FakeSource(), FakeBackend()
    source.publish(make_world(3, ["w-0", ME]))
    m = manager(source, backend)
    assert m.join(-1).generation == 3
    assert (m.rank, backend.inits) == (1, [(3, 1)])


def test_before_joining_once_it_waits_for_a_world_that_includes_it() -> None:
    source, backend = FakeSource(), FakeBackend()
    source.publish(make_world(0, ["w-0"]))
    m = manager(source, backend)
    later = threading.Timer(0.1, source.publish, args=(make_world(1, ["w-0", ME]),))
    later.start()
    assert m.join(-1).generation == 1
    assert backend.inits == [(1, 1)]


def test_a_newcomer_answers_every_world_without_it_with_a_joining_report() -> None:
    source, backend, reporter = FakeSource(), FakeBackend(), FakeReporter()
    source.publish(make_world(0, ["w-0"]))
    m = manager(source, backend, reporter)
    later = [threading.Timer(0.1, source.publish, args=(make_world(1, ["w-0", "w-2"]),)),
             threading.Timer(0.3, source.publish, args=(make_world(2, ["w-0", "w-2", ME]),))]
    for timer in later:
        timer.start()
    assert m.join(-1).generation == 2
    assert [(k, g) for k, g, _ in reporter.reports] == [(ReportKind.JOINING, 0),
                                                        (ReportKind.JOINING, 1)]


def test_once_joined_a_world_without_it_means_leave_cleanly() -> None:
    source, backend = FakeSource(), FakeBackend()
    source.publish(make_world(0, ["w-0", ME]))
    m = manager(source, backend)
    m.join(-1)
    source.publish(make_world(1, ["w-0"]))
    with pytest.raises(LeftWorld) as left:
        m.join(0)
    assert left.value.code == 0
    assert "not a member of world generation 1" in str(left.value)
    assert backend.shutdowns >= 1


def test_a_superseded_world_is_skipped_for_the_newer_one() -> None:
    source, backend = FakeSource(), FakeBackend()
    source.publish(make_world(0, ["w-0", ME]))
    backend.fail_init[0] = Superseded()
    threading.Timer(0.05, source.publish, args=(make_world(1, [ME]),)).start()
    m = manager(source, backend)
    assert m.join(-1).generation == 1
    assert backend.inits == [(0, 1), (1, 0)]


@pytest.mark.parametrize(
    ("error", "kind"),
    [(CollectiveError("peer gone"), ReportKind.COLLECTIVE_FAILED),
     (RankTaken("rank 1 claimed"), ReportKind.NO_STATE)],
)
def test_a_failed_join_is_reported_and_the_next_world_awaited(
        error: CollectiveError, kind: ReportKind) -> None:
    source, backend = FakeSource(), FakeBackend()
    source.publish(make_world(0, ["w-0", ME]))
    backend.fail_init[0] = error
    reporter = FakeReporter(on_report=lambda k, e: source.publish(make_world(e + 1, [ME])))
    m = manager(source, backend, reporter)
    assert m.join(-1).generation == 1
    assert [(k, e) for k, e, _ in reporter.reports] == [(kind, 0)]


def test_members_absent_until_the_rendezvous_deadline_are_named_in_the_report() -> None:
    # Unnamed, the world would be republished as it was and wait for them again.
    source, backend = FakeSource(), FakeBackend()
    source.publish(make_world(0, ["w-0", ME, "w-2", "w-3"]))
    backend.fail_init[0] = RanksAbsent("only 2 of 4 members arrived", (0, 1, 3))
    reporter = FakeReporter(on_report=lambda k, e: source.publish(make_world(e + 1, [ME])))
    assert manager(source, backend, reporter).join(-1).generation == 1
    assert [k for k, _, _ in reporter.reports] == [ReportKind.COLLECTIVE_FAILED]
    assert reporter.suspects == [("w-0", "w-3")]


def test_no_world_in_time_is_an_error() -> None:
    source = FakeSource()
    m = GroupManager(source, FakeBackend(), ME, RuntimeSettings(world_wait_timeout_s=0.05),
                     FakeReporter(), StallWatchdog(0))
    with pytest.raises(WorldTimeout):
        m.join(-1)


def test_check_world_raises_on_every_rank_when_any_rank_saw_a_newer_generation() -> None:
    source, backend = FakeSource(), FakeBackend()
    source.publish(make_world(2, [ME]))
    m = manager(source, backend)
    m.join(-1)
    m.check_world()
    backend.max_seen = 3  # another rank has seen generation 3 already, this one not yet
    with pytest.raises(WorldChanged) as changed:
        m.check_world()
    assert changed.value.generation == 3


def test_a_member_dropped_after_a_failure_fences_itself_non_zero() -> None:
    source, backend = FakeSource(), FakeBackend()
    source.publish(make_world(1, ["w-0", ME]))
    m = manager(source, backend)
    m.join(-1)
    m.failed(CollectiveError("peer gone"))
    source.publish(make_world(2, ["w-0"]))
    with pytest.raises(Fenced) as fenced:
        m.join(1)
    assert fenced.value.code == FENCED_EXIT != 0


def test_a_member_that_finds_no_world_after_a_failure_fences_itself() -> None:
    source, backend = FakeSource(), FakeBackend()
    source.publish(make_world(1, ["w-0", ME]))
    settings = RuntimeSettings(fence_timeout_s=0.3)
    m = GroupManager(source, backend, ME, settings, FakeReporter(), StallWatchdog(0))
    m.join(-1)
    m.failed(CollectiveError("peer gone"))
    with pytest.raises(Fenced, match="no newer world"):
        m.join(1)


def test_a_failed_collective_aborts_the_group_so_blocked_peers_fail_too() -> None:
    source, backend = FakeSource(), FakeBackend()
    source.publish(make_world(1, ["w-0", ME, "w-2"]))
    m = manager(source, backend, FakeReporter())
    m.join(-1)
    m.failed(CollectiveError("connection reset by w-2"))
    assert backend.aborted is not None and "connection reset by w-2" in backend.aborted


def test_reports_in_a_generation_name_the_peers_found_dead() -> None:
    source, backend, reporter = FakeSource(), FakeBackend(), FakeReporter()
    source.publish(make_world(1, ["w-0", ME, "w-2"]))
    m = manager(source, backend, reporter)
    m.join(-1)
    backend.peers_dead(PeerFailure(1, ("w-2",), "w-2 (rank 2): no heartbeat for 3.0s"))
    assert backend.aborted is not None
    m.failed(CollectiveError("allreduce aborted"))
    assert [k for k, _, _ in reporter.reports] == [ReportKind.PEER_DEAD,
                                                  ReportKind.COLLECTIVE_FAILED]
    assert reporter.suspects == [("w-2",), ("w-2",)]
    # The later report replaces the first at the operator: it keeps the evidence,
    # whatever error the training thread saw.
    assert "allreduce aborted" in reporter.reports[-1][2]
    assert "no heartbeat for 3.0s" in reporter.reports[-1][2]
    # A new generation starts with a clean slate.
    source.publish(make_world(2, ["w-0", ME]))
    m.join(1)
    m.report(ReportKind.STALLED)
    assert reporter.suspects[-1] == ()


class CountingWatchdog(StallWatchdog):
    def __init__(self) -> None:
        super().__init__(0)
        self.beats = 0

    def beat(self) -> None:
        self.beats += 1


def test_waiting_alive_for_a_world_beats_the_watchdog() -> None:
    source, backend = FakeSource(), FakeBackend()
    dog = CountingWatchdog()
    m = GroupManager(source, backend, ME, RuntimeSettings(), FakeReporter(), dog)
    timer = threading.Timer(2.5, source.publish, [make_world(1, [ME])])
    timer.start()
    m.join(-1)
    timer.join()
    assert dog.beats >= 2, "one beat per wait slice, so a long wait is not a stall"


class Exits:
    """Stands in for ``os._exit``: records the status instead of ending the test."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.called = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.called.set()


def stuck_member(reporter: FakeReporter, exits: Exits) -> tuple[FakeSource, GroupManager,
                                                                  FakeBackend]:
    """A member of generation 1 whose heartbeats just found ``w-0`` dead."""
    source, backend = FakeSource(), FakeBackend()
    source.publish(make_world(1, ["w-0", ME]))
    m = GroupManager(source, backend, ME, RuntimeSettings(failure_detect_s=0.2), reporter,
                     StallWatchdog(0), exit_process=exits)
    m.join(-1)
    backend.peers_dead(PeerFailure(1, ("w-0",), "w-0 (rank 0): no heartbeat for 0.2s"))
    return source, m, backend


def test_a_member_stuck_in_the_aborted_collective_fences_itself_once_left_out() -> None:
    reporter, exits = FakeReporter(), Exits()
    source, _, _ = stuck_member(reporter, exits)
    # The training thread never comes back (a send the abort did not end); the survivors
    # publish a world without this pod.
    source.publish(make_world(2, ["w-0"]))
    assert exits.called.wait(30), "the stuck member never fenced itself"
    assert exits.codes == [FENCED_EXIT]
    kind, generation, detail = reporter.reports[-1]
    assert (kind, generation) == (ReportKind.LEFT, 1)
    assert "not a member of world generation 2" in detail


def test_a_training_thread_that_comes_back_fences_itself_the_usual_way() -> None:
    reporter, exits = FakeReporter(), Exits()
    source, m, _ = stuck_member(reporter, exits)
    m.failed(CollectiveError("allreduce aborted"))
    source.publish(make_world(2, ["w-0"]))
    with pytest.raises(Fenced):
        m.join(1)
    # Well past the grace and a wait slice: the side thread stood down.
    assert not exits.called.wait(1.5)


def test_a_member_stuck_while_the_next_world_still_includes_it_is_left_alone() -> None:
    reporter, exits = FakeReporter(), Exits()
    source, _, _ = stuck_member(reporter, exits)
    source.publish(make_world(2, ["w-0", ME]))
    assert not exits.called.wait(1.5)



def _with_uids(world: World, uids: dict[str, str]) -> World:
    members = tuple(m.model_copy(update={"pod_uid": uids.get(m.pod, "")})
                    for m in world.members)
    return world.model_copy(update={"members": members})


def test_a_process_of_a_deleted_pod_does_not_take_its_namesakes_place() -> None:
    source, backend = FakeSource(), FakeBackend()
    source.publish(_with_uids(make_world(1, ["w-0", ME]), {"w-0": "u0", ME: "old"}))
    m = GroupManager(source, backend, ME, RuntimeSettings(world_wait_timeout_s=5),
                     FakeReporter(), StallWatchdog(0), pod_uid="old")
    assert m.join(-1).generation == 1
    # The pod was deleted and replaced under its name while this process still ran.
    source.publish(_with_uids(make_world(2, ["w-0", ME]), {"w-0": "u0", ME: "new"}))
    with pytest.raises(Fenced, match="successor") as fenced:
        m.join(1)
    assert fenced.value.code == FENCED_EXIT
    assert backend.inits == [(1, 1)]  # never formed generation 2 as its successor's rank


def test_a_newcomer_whose_name_belongs_to_another_uid_never_joins() -> None:
    # The deleted pod's process that never trained: it waits as a newcomer would (its
    # reports, sealed with the deleted pod's key, count for nobody) and never forms the
    # group under its successor's rank.
    source, backend, reporter = FakeSource(), FakeBackend(), FakeReporter()
    source.publish(_with_uids(make_world(3, ["w-0", ME]), {ME: "new"}))
    m = GroupManager(source, backend, ME, RuntimeSettings(world_wait_timeout_s=0.5),
                     reporter, StallWatchdog(0), pod_uid="old")
    with pytest.raises(WorldTimeout):
        m.join(-1)
    assert backend.inits == []
    assert [(kind, generation) for kind, generation, _ in reporter.reports] == [
        (ReportKind.JOINING, 3)]


def test_a_replacement_that_starts_before_the_world_without_its_predecessor_waits_to_join(
) -> None:
    # The pod was deleted and created again; the new process reads the world while it
    # still names the deleted pod (its uid): it asks to join, and joins the world that
    # names it with its own uid.
    source, backend = FakeSource(), FakeBackend()
    source.publish(_with_uids(make_world(3, ["w-0", ME]), {"w-0": "u0", ME: "old"}))

    def operator(kind: ReportKind, generation: int) -> None:
        if kind is ReportKind.JOINING and generation == 3:
            source.publish(_with_uids(make_world(4, ["w-0"]), {"w-0": "u0"}))
        elif kind is ReportKind.JOINING and generation == 4:
            source.publish(_with_uids(make_world(5, ["w-0", ME]), {"w-0": "u0", ME: "new"}))

    reporter = FakeReporter(on_report=operator)
    m = GroupManager(source, backend, ME, RuntimeSettings(world_wait_timeout_s=5),
                     reporter, StallWatchdog(0), pod_uid="new")
    assert m.join(-1).generation == 5
    assert [(k, g) for k, g, _ in reporter.reports] == [
        (ReportKind.JOINING, 3), (ReportKind.JOINING, 4)]
    assert backend.inits == [(5, 1)]


def test_uids_unknown_on_either_side_match_by_name() -> None:
    source, backend = FakeSource(), FakeBackend()
    source.publish(_with_uids(make_world(3, ["w-0", ME]), {ME: "u1"}))
    m = manager(source, backend)  # no uid: a local run
    assert m.join(-1).generation == 3
