"""The group manager: follow the world, form each generation's group, leave when dropped.

On a new generation every member of the new world tears down its old group and forms the
new one with its rank from the world. Which member's state everyone then adopts is
decided by :func:`choose_source` from what each member reports about itself, so all
members reach the same answer without a coordinator.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ringwright.world import Member, ReportKind, World

from ..kvlog import log_event, runtime_logger
from ..membership.health import StallWatchdog
from ..membership.liveness import PeerFailure
from ..membership.reporter import Reporter
from ..membership.source import MembershipSource, WorldTimeout
from ..settings import RuntimeSettings
from .backend import CollectiveBackend, CollectiveError, RanksAbsent, RankTaken, Superseded

_log = runtime_logger("group")


class WorldChanged(Exception):
    """Every rank agreed at a commit that a newer world is out; rebuild without rollback."""

    def __init__(self, generation: int) -> None:
        super().__init__(f"world generation {generation} published")
        self.generation = generation


FENCED_EXIT = 75
"""Exit status of a member that fenced itself (EX_TEMPFAIL: a restart may rejoin)."""

WAIT_SLICE_S = 1.0
"""Longest single wait for a world; the watchdog is told between slices that this
member is alive and waiting, not hung."""


class Fenced(SystemExit):
    """Cut off after a failure: dropped from the world, or no world that includes this
    pod in time. Stops training for good (non-zero exit) so that no two groups ever
    train the same job."""

    def __init__(self, pod: str, why: str) -> None:
        super().__init__(FENCED_EXIT)
        self.message = f"ringwright: pod {pod} fenced itself after a failure: {why}"

    def __str__(self) -> str:
        return self.message


class LeftWorld(SystemExit):
    """This pod is not in the newest world: leave cleanly (exit status 0)."""

    def __init__(self, pod: str, world: World) -> None:
        super().__init__(0)
        self.world = world
        self.message = (
            f"ringwright: pod {pod} is not a member of world generation {world.generation} "
            f"(size {world.size}); leaving the job cleanly"
        )

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class MemberInfo:
    """What one member of a new world says about the state it holds."""

    pod: str
    state_generation: int
    """Generation of the world this member's state was last synced in; -1 for none."""
    state_rank: int
    """This member's rank in that world."""
    step: int


def choose_source(infos: Sequence[MemberInfo]) -> int | None:
    """New-world rank whose state every member adopts; None when nobody holds state.

    The holders of the newest state are the survivors of the latest world that
    trained; among them the lowest-ranked member of that world is chosen.
    """
    holders = [(i, info) for i, info in enumerate(infos) if info.state_generation >= 0]
    if not holders:
        return None
    newest = max(info.state_generation for _, info in holders)
    rank, _ = min(
        ((i, info) for i, info in holders if info.state_generation == newest),
        key=lambda pair: pair[1].state_rank,
    )
    return rank


class GroupManager:
    """Joins this pod into successive worlds through a collective backend."""

    def __init__(
        self,
        source: MembershipSource,
        backend: CollectiveBackend,
        pod: str,
        settings: RuntimeSettings,
        reporter: Reporter,
        watchdog: StallWatchdog,
        *,
        local_rank: int = 0,
        pod_uid: str = "",
        clock: Callable[[], float] = time.monotonic,
        exit_process: Callable[[int], object] = os._exit,
    ) -> None:
        self._source = source
        self._backend = backend
        self.pod = pod
        self.local_rank = local_rank
        """This process's rank inside its pod (``LOCAL_RANK``)."""
        self.pod_uid = pod_uid
        """This pod's uid ("" where unknown, as in local runs)."""
        self._settings = settings
        self._reporter = reporter
        self._watchdog = watchdog
        self._clock = clock
        self._exit = exit_process
        self._back = threading.Event()
        """Set once the training thread came back to the manager after a peer was found
        dead (it reported the failure, left cleanly, or waits for a world)."""
        self._world: World | None = None
        self._rank = -1
        self._ever_joined = False
        self._failing = False
        self._suspects: dict[int, PeerFailure] = {}
        """Pods found dead and the evidence, by generation (only the current generation's
        are kept)."""

    @property
    def backend(self) -> CollectiveBackend:
        """The collectives of the current world."""
        return self._backend

    @property
    def world(self) -> World:
        """The world this pod last joined."""
        if self._world is None:
            raise RuntimeError("not in any world yet")
        return self._world

    @property
    def rank(self) -> int:
        """This pod's rank in :attr:`world`."""
        return self._rank

    @property
    def generation(self) -> int:
        """Generation of the current world; -1 before the first."""
        return self._world.generation if self._world is not None else -1

    def _named_in(self, world: World) -> bool:
        """Whether ``world`` names this pod (by name, and by uid where both are known)."""
        entry = world.member(self.pod)
        return entry is not None and not self._namesake(entry)

    def _namesake(self, entry: Member) -> bool:
        return bool(entry.pod_uid and self.pod_uid and entry.pod_uid != self.pod_uid)

    def _entry(self, world: World) -> Member | None:
        """This process's entry in ``world``, or None when it is not a member.

        An entry under this pod's name with another uid is never this process's. A
        process that has trained finds there its successor (its pod was deleted while it
        still ran: the grace period, a node cut off from the API server) and fences
        itself rather than take its place. A process that never joined cannot tell its
        predecessor's entry (a replacement starting before the world without the deleted
        pod is out) from its successor's: it is not a member, and waits like a newcomer.
        """
        me = world.member(self.pod, self.local_rank)
        if me is None or not self._namesake(me):
            return me
        if not self._ever_joined:
            return None
        self._backend.shutdown()
        raise Fenced(self.pod, f"world generation {world.generation} gives this pod's name "
                               f"to its successor (uid {me.pod_uid}, this pod's is "
                               f"{self.pod_uid}): this pod was deleted")

    def join(self, after_generation: int) -> World:
        """Form the group of the newest world after ``after_generation`` that includes this pod.

        Before this process first joined, worlds without it are waited out (the
        operator has not added it yet), each answered with a ``joining`` report: the
        operator adds it once it is ready. Afterwards, a newer world without it means it
        was dropped: :class:`LeftWorld` is raised, or :class:`Fenced` after a failure
        (also when no world comes within ``fence_timeout_s``).
        """
        s = self._settings
        deadline = self._clock() + (s.fence_timeout_s if self._failing
                                    else s.world_wait_timeout_s)
        after = after_generation
        while True:
            world = self._wait_for_world(after, deadline)
            after = world.generation
            me = self._entry(world)
            if me is None:
                if self._ever_joined:
                    self._backend.shutdown()
                    if self._failing:
                        raise Fenced(self.pod,
                                     f"not a member of world generation {world.generation}")
                    raise LeftWorld(self.pod, world)
                log_event(_log, logging.INFO, "waiting_for_membership", pod=self.pod,
                          generation=world.generation, size=world.size)
                # Ready to take part: whoever publishes worlds adds this pod only now,
                # so its peers never wait for a process that is still starting.
                self._reporter.report(ReportKind.JOINING, world.generation,
                                      "started and waiting for a world that includes it")
                continue
            started = self._clock()
            self._suspects = {}
            try:
                self._backend.init(world, me.rank, self._superseded_by(world),
                                   self._peer_failed)
            except Superseded:
                log_event(_log, logging.INFO, "join_superseded", generation=world.generation)
                self._backend.shutdown()
                continue
            except CollectiveError as err:
                self._backend.shutdown()
                kind = ReportKind.NO_STATE if isinstance(err, RankTaken) else \
                    ReportKind.COLLECTIVE_FAILED
                # Those absent for the whole rendezvous timeout are named: republished
                # as it was, the world would wait for them again, and again.
                absent = _pods_of(world, err.ranks, self.pod) \
                    if isinstance(err, RanksAbsent) else ()
                self._reporter.report(kind, world.generation, f"joining: {err}", absent)
                log_event(_log, logging.WARNING, "join_failed", generation=world.generation,
                          rank=me.rank, error=err)
                continue
            self._world, self._rank, self._ever_joined = world, me.rank, True
            self._failing = False
            log_event(_log, logging.INFO, "joined", pod=self.pod, generation=world.generation,
                      rank=me.rank, size=world.size, backend=self._backend.name,
                      seconds=self._clock() - started)
            return world

    def check_world(self) -> None:
        """Agree with every rank on the newest generation seen; raise WorldChanged if newer."""
        latest = self._source.latest()
        seen = max(latest.generation if latest is not None else -1, self.generation)
        agreed = self._backend.allreduce_max(seen)
        if agreed > self.generation:
            log_event(_log, logging.INFO, "world_change_agreed", generation=self.generation,
                      next_generation=agreed)
            raise WorldChanged(agreed)

    def progress(self) -> None:
        """The training loop advanced."""
        self._watchdog.beat()

    def busy(self) -> contextlib.AbstractContextManager[None]:
        """The training loop does work without steps: pause the stall watchdog."""
        return self._watchdog.paused()

    def report(self, kind: ReportKind, detail: str = "") -> None:
        """Tell the operator something about this pod in the current generation, naming
        the peers found dead in it so far with the evidence (a later report replaces an
        earlier one, so the evidence must travel with every report that names them)."""
        generation = max(self.generation, 0)
        found = self._suspects.get(generation)
        if found is None:
            self._reporter.report(kind, generation, detail)
            return
        self._reporter.report(kind, generation, f"{detail[:600]}; found dead: {found.evidence}",
                              found.pods)

    def failed(self, err: CollectiveError) -> None:
        """The group broke: abort it here too, report it; from now on a world without
        this pod fences it.

        The abort closes this member's connections, so peers still blocked in a
        collective with it fail at once instead of at their heartbeat verdict: a
        killed peer resets only the connections it had, and in a ring most members
        do not talk to it directly.
        """
        self._failing = True
        self._back.set()
        self._backend.abort(f"a collective failed here: {err}")
        self.report(ReportKind.COLLECTIVE_FAILED, str(err))

    def leave_cleanly(self) -> None:
        """Every member agreed to move on: leave the group without alarming anyone."""
        self._back.set()
        self._backend.shutdown(left_cleanly=True)

    def _peer_failed(self, failure: PeerFailure) -> None:
        # Called from the heartbeat thread; the backend aborts the group next.
        self._suspects = {failure.generation: failure}
        self._reporter.report(ReportKind.PEER_DEAD, failure.generation, failure.evidence,
                              failure.pods)
        self._back.clear()
        threading.Thread(target=self._fence_if_stuck, args=(failure.generation,),
                         name="ringwright-fence", daemon=True).start()

    def _fence_if_stuck(self, generation: int) -> None:
        """Fence this process from here when the training thread stays blocked in the
        aborted collective and a newer world has left this pod out.

        The abort fails the blocked collective at once, as a rule. Not always: a member
        frozen mid-collective (SIGSTOP) and woken after the survivors moved on stayed
        blocked for the whole collective timeout, with Horovod (its background thread
        waiting in a gloo send, ``UnboundBuffer::waitSend``) and with torch's gloo
        group. Dropped after a failure, it has nothing left to do but fence itself, so
        it does, ``failure_detect_s`` after the abort at the earliest.
        """
        earliest = self._clock() + self._settings.failure_detect_s
        while not self._back.wait(WAIT_SLICE_S):
            latest = self._source.latest()
            if (self._clock() >= earliest and latest is not None
                    and latest.generation > generation and not self._named_in(latest)):
                fenced = Fenced(self.pod, f"not a member of world generation "
                                          f"{latest.generation}, and still blocked in the "
                                          f"aborted collective of generation {generation}")
                log_event(_log, logging.WARNING, "fenced", pod=self.pod, message=fenced.message)
                self._reporter.report(ReportKind.LEFT, generation, fenced.message)
                self._reporter.close()
                for handler in logging.getLogger().handlers:
                    handler.flush()
                # The training thread is inside the library: only ending the process
                # stops it.
                self._exit(FENCED_EXIT)
                return

    def _wait_for_world(self, after: int, deadline: float) -> World:
        while True:
            self._watchdog.beat()
            self._back.set()  # the training thread is here, not stuck in a collective
            left = deadline - self._clock()
            try:
                return self._source.wait_for_world(after, max(min(left, WAIT_SLICE_S), 0.0))
            except WorldTimeout:
                if self._clock() < deadline:
                    continue
                if self._failing:
                    raise Fenced(self.pod, f"no newer world than generation {after} within "
                                           f"{self._settings.fence_timeout_s:.0f}s") from None
                raise

    def _superseded_by(self, world: World) -> Callable[[], bool]:
        def superseded() -> bool:
            # Asked between short waits while forming: alive and waiting, not hung.
            self._watchdog.beat()
            latest = self._source.latest()
            return latest is not None and latest.generation > world.generation

        return superseded


def _pods_of(world: World, ranks: tuple[int, ...], me: str) -> tuple[str, ...]:
    """The pods other than ``me`` holding ``ranks`` in ``world``, once each."""
    wanted = set(ranks)
    return tuple(dict.fromkeys(m.pod for m in world.members
                               if m.rank in wanted and m.pod != me))
