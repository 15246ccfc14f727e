"""Which members are slow for good: one rule for the operator and the local launcher.

A member is slow when the median compute time of its steps (the step less the time it
waited for peers in the gradient all-reduce; :class:`~ringwright.world.MemberStats`)
exceeds the median of its peers' by a factor. In a ring every member's whole step takes
as long as the slowest one's, so only the compute part tells the slow member from those
waiting for it. Medians over the last steps make a one-off pause one slow step among
many, and a member must stay slow for a window before it is a straggler, so a slow
minute costs nothing either.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from .world import MemberStats, World

MIN_STEPS_TIMED = 8
"""Steps a member must have timed in the current world before it is compared."""


def slowness(stats: Mapping[str, MemberStats], world: World) -> dict[str, float]:
    """Each member's compute time over its peers' median, for the members of ``world``
    that timed enough steps in it; empty with fewer than two such members."""
    timed = {pod: st.compute_seconds for pod in world.pods
             if (st := stats.get(pod)) is not None and st.generation == world.generation
             and st.steps_timed >= MIN_STEPS_TIMED and st.compute_seconds > 0}
    if len(timed) < 2:
        return {}
    out = {}
    for pod, mine in timed.items():
        peers = statistics.median(v for p, v in timed.items() if p != pod)
        out[pod] = mine / peers if peers > 0 else 0.0
    return out


@dataclass(frozen=True)
class StragglerRule:
    """How slow, for how long (the SchedulingPolicy's ``stragglers`` in a cluster), and
    how many replacements may be started (a local launcher's stand-in for free room)."""

    factor: float = 1.5
    window_s: float = 300.0
    spares: int = 0


@dataclass(frozen=True)
class SlowWatch:
    """The slow members and since when each was slow; those slow for the window."""

    since: dict[str, float]
    stragglers: tuple[str, ...]


def watch(ratios: Mapping[str, float], since: Mapping[str, float], *, factor: float,
          window_s: float, now: float) -> SlowWatch:
    """Who is slow now (``ratios`` at or above ``factor``), since when (kept from
    ``since`` while they stay slow: a member that keeps pace once starts over), and who
    has been slow for ``window_s``, slowest first."""
    slow = {pod: since.get(pod, now) for pod, ratio in ratios.items() if ratio >= factor}
    flagged = sorted((pod for pod, t in slow.items() if now - t >= window_s),
                     key=lambda pod: (-ratios[pod], pod))
    return SlowWatch(slow, tuple(flagged))


def faster_without(ratio: float, size: int) -> bool:
    """Whether a ring of ``size`` members, one of them ``ratio`` times slower than the
    rest, makes more progress without it: ``size - 1`` members at full speed against
    ``size`` at the slow member's (data-parallel throughput grows with the members)."""
    return size > 1 and (size - 1) * ratio > size
