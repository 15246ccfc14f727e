"""Fakes for the runtime's interfaces, keeping their semantics (one rank, in memory)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import torch

from ringwright.runtime.collectives.backend import CollectiveError, PeerFailureListener
from ringwright.runtime.membership.liveness import PeerFailure
from ringwright.runtime.membership.source import WorldBox
from ringwright.world import JobRef, Member, MemberStats, ReportKind, StoreAddress, World

T = TypeVar("T")


def make_world(generation: int, pods: Sequence[str]) -> World:
    members = tuple(Member(rank=i, pod=p, ip=f"127.0.0.{10 + i}") for i, p in enumerate(pods))
    return World(job=JobRef(namespace="local", name="j"), generation=generation, members=members,
                 store=StoreAddress(address="127.0.0.10", port=29400))


class FakeSource:
    """An in-memory membership source: tests publish, the runtime waits."""

    def __init__(self) -> None:
        self.box = WorldBox()

    def publish(self, world: World) -> None:
        self.box.offer(world, "test")

    def latest(self) -> World | None:
        return self.box.latest()

    def wait_for_world(self, after_generation: int, timeout: float) -> World:
        return self.box.wait_newer(after_generation, timeout)

    def close(self) -> None:
        return


class FakeBackend:
    """A one-member group; ``fail_*`` inject the failures a dead peer would cause."""

    def __init__(self) -> None:
        self.inits: list[tuple[int, int]] = []
        self.shutdowns = 0
        self.closed = False
        self.gradient_calls = 0
        self.fail_gradients_at: set[int] = set()
        """Calls of allreduce_gradients (1-based) that raise CollectiveError."""
        self.fail_init: dict[int, Exception] = {}
        """Generations whose init raises the given exception."""
        self.max_seen = -1
        """What other ranks report to allreduce_max."""
        self.clean_shutdowns = 0
        self.aborted: str | None = None
        self.on_peer_failure: PeerFailureListener | None = None
        self.flat_calls: list[str] = []
        """Names passed to allreduce_ (a one-member sum leaves the tensor as it is)."""

    @property
    def name(self) -> str:
        return "fake"

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def init(self, world: World, rank: int, superseded: Callable[[], bool],
             on_peer_failure: PeerFailureListener) -> None:
        self.inits.append((world.generation, rank))
        self.aborted = None
        self.on_peer_failure = on_peer_failure
        if world.generation in self.fail_init:
            raise self.fail_init[world.generation]

    def peers_dead(self, failure: PeerFailure) -> None:
        """What the heartbeat thread does on a verdict: tell the manager, then abort."""
        assert self.on_peer_failure is not None
        self.on_peer_failure(failure)
        self.abort(failure.evidence)

    def abort(self, reason: str) -> None:
        self.aborted = reason

    def failure_of(self, err: BaseException) -> CollectiveError | None:
        if isinstance(err, CollectiveError):
            return err
        if isinstance(err, RuntimeError) and self.aborted is not None:
            return CollectiveError(f"{err} (aborted: {self.aborted})")
        return None

    def shutdown(self, *, left_cleanly: bool = False) -> None:
        self.shutdowns += 1
        self.clean_shutdowns += left_cleanly

    def close(self) -> None:
        self.closed = True

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], src: int) -> None:
        assert src == 0

    def broadcast_object(self, obj: T, src: int) -> T:
        assert src == 0
        return obj

    def allgather_object(self, obj: T) -> list[T]:
        return [obj]

    def allreduce_gradients(self, params: Iterable[torch.Tensor], *, average: bool) -> None:
        self.gradient_calls += 1
        if self.gradient_calls in self.fail_gradients_at:
            raise CollectiveError("peer vanished")

    def allreduce_(self, flat: torch.Tensor, name: str) -> None:
        self.flat_calls.append(name)

    def allreduce_max(self, value: int) -> int:
        return max(value, self.max_seen)

    def barrier(self) -> None:
        return


class FakeReporter:
    """Records reports; ``on_report`` lets a test play the operator's reaction."""

    def __init__(self, on_report: Callable[[ReportKind, int], None] | None = None) -> None:
        self.reports: list[tuple[ReportKind, int, str]] = []
        self.suspects: list[tuple[str, ...]] = []
        self.sent_stats: list[MemberStats] = []
        self._on_report = on_report

    def report(self, kind: ReportKind, generation: int, detail: str = "",
               suspects: Sequence[str] = ()) -> None:
        self.reports.append((kind, generation, detail))
        self.suspects.append(tuple(suspects))
        if self._on_report is not None:
            self._on_report(kind, generation)

    def stats(self, stats: MemberStats) -> None:
        self.sent_stats.append(stats)

    def close(self) -> None:
        return
