"""The job's goodput and checkpoint interval, from the members' stats (pure).

Every member process reports its seconds per phase since it started
(:class:`~ringwright.world.MemberStats`). The status keeps, per pod, the figures last
counted and adds only their growth to the job's totals, so the totals cover the job's
whole life: a replaced pod's time stays counted, and a new process under the same name
(told apart by its start time) counts from zero.
"""

from __future__ import annotations

from collections.abc import Mapping

from ringwright.world import MemberStats, Phase, World

from ...api.models import CheckpointIntervalStatus, GoodputStatus, MemberTime


def goodput(stats: Mapping[str, MemberStats], previous: GoodputStatus | None
            ) -> GoodputStatus | None:
    """The job's goodput after counting ``stats`` (by pod); None before any stats."""
    if not stats and previous is None:
        return None
    totals = dict(previous.seconds) if previous else {}
    members = dict(previous.members) if previous else {}
    for pod, st in sorted(stats.items()):
        now = {phase.value: seconds for phase, seconds in st.seconds.items()}
        seen = members.get(pod)
        counted = seen.seconds if seen is not None and seen.since == st.since else {}
        for phase, seconds in now.items():
            grown = max(seconds - counted.get(phase, 0.0), 0.0)
            totals[phase] = round(totals.get(phase, 0.0) + grown, 3)
        members[pod] = MemberTime(since=st.since, seconds=now)
    # Pods whose stats are gone are gone themselves: their time stays in the totals.
    members = {pod: t for pod, t in members.items() if pod in stats}
    whole = sum(totals.values())
    fractions = {p.value: round(totals.get(p.value, 0.0) / whole, 4) if whole else 0.0
                 for p in Phase}
    return GoodputStatus.model_validate({**fractions, "seconds": totals, "members": members})


def checkpoint_interval(stats: Mapping[str, MemberStats], world: World | None, auto: bool
                        ) -> CheckpointIntervalStatus | None:
    """The interval the checkpoint writer (rank 0 of ``world``) follows, from its stats in
    that world; None when it has not reported one there yet."""
    if world is None or not world.members:
        return None
    writer = stats.get(world.members[0].pod)
    if writer is None or writer.generation != world.generation:
        return None
    return CheckpointIntervalStatus(
        steps=writer.checkpoint_interval_steps, auto=auto,
        write_seconds=writer.checkpoint_write_seconds, mtbf_seconds=writer.mtbf_seconds)
