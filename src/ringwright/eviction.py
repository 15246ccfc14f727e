"""Which members to drop from a world on the word of their peers: one rule for the
operator and the local launcher.

A member that finds a peer silent reports it (``Report.suspects``). One report is
never enough to evict a healthy peer: a member cut off from everyone finds *all* its
peers silent. A suspect is evicted when enough members of the same generation name it
(``quorum``: two, or one in a world of two), or when one does and the judge's own
view agrees (the pod is gone, not running, or fails its readiness probe). A voter
that is itself evicted loses its vote, and suspects are weighed most-named first,
so the side of a partition holding fewer members loses, and in a tie the higher
ranks go (rank 0 hosts the store).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from .world import Report, ReportKind, World


@dataclass(frozen=True)
class Eviction:
    """A member to drop, with the members that named it."""

    pod: str
    reporters: tuple[str, ...]
    reason: str


def quorum(world: World) -> int:
    """Reporters needed to evict a member on their word alone. Reporters and suspects
    are pods: the local ranks of one pod share its report and its fate."""
    return 2 if len(world.pods) > 2 else 1


def judge(world: World, reports: Mapping[str, Report],
          suspect_by_own_view: Collection[str] = ()) -> list[Eviction]:
    """Members of ``world`` to evict on the reports of its generation, in rank order.

    ``reports`` maps reporting pod to its newest report; reports of other generations,
    from non-members, or naming non-members are ignored. ``suspect_by_own_view``
    are members the judge itself sees as unhealthy (one reporter then suffices).
    """
    rank: dict[str, int] = {}
    for m in world.members:
        rank.setdefault(m.pod, m.rank)  # a pod ranks by its local rank 0
    votes: dict[str, set[str]] = {}
    for reporter, report in reports.items():
        if report.generation != world.generation or reporter not in rank:
            continue
        for suspect in report.suspects:
            if suspect in rank and suspect != reporter:
                votes.setdefault(suspect, set()).add(reporter)
    need = quorum(world)
    evicted: dict[str, Eviction] = {}
    for suspect in sorted(votes, key=lambda p: (-len(votes[p]), -rank[p])):
        voters = votes[suspect] - evicted.keys()
        own = suspect in suspect_by_own_view
        if len(voters) >= need or (voters and own):
            why = (f"named dead by {len(voters)} of {len(world.pods)} pods of generation "
                   f"{world.generation}"
                   + (" and unhealthy in the judge's own view" if own else ""))
            evicted[suspect] = Eviction(suspect, tuple(sorted(voters)), why)
    return sorted(evicted.values(), key=lambda e: rank[e.pod])


def needs_new_generation(world: World, reports: Mapping[str, Report], now: float,
                         verdict_wait_s: float) -> str | None:
    """Why the same membership must be republished under a new generation, if it must.

    A member that restarted without state (``no-state``) cannot take its rank in the
    current generation. A member whose collective failed without anyone being found dead
    (no suspects) within ``verdict_wait_s`` waits for a world that nothing else
    would publish. ``now`` and ``Report.at`` are wall-clock seconds.
    """
    members = {m.pod for m in world.members}
    for pod, report in sorted(reports.items()):
        if pod not in members or report.generation != world.generation:
            continue
        if report.kind is ReportKind.NO_STATE:
            return f"{pod} restarted without state"
        if report.kind is ReportKind.COLLECTIVE_FAILED and not report.suspects \
                and now - report.at >= verdict_wait_s:
            return f"{pod}'s collective failed and no member was found dead"
    return None


WAITING = (ReportKind.COLLECTIVE_FAILED, ReportKind.PEER_DEAD)
"""Reports of a member that stopped training in its generation and waits for the next world."""


def all_waiting(world: World, reports: Mapping[str, Report], survivors: Collection[str]) -> bool:
    """Whether every one of ``survivors`` (members of ``world`` that stay) has stopped
    training in ``world``'s generation and waits for the next world.

    Then a settle window only delays them all: nothing it could gather (a burst of
    pod events) is worth more than the time every survivor stands still.
    """
    members = {m.pod for m in world.members}
    return bool(survivors) and all(
        pod in members and (r := reports.get(pod)) is not None and r.generation == world.generation
        and r.kind in WAITING for pod in survivors)

