"""Members slow for good (pure): who is slow, for how long, and the node to avoid.

A member is slow when the median compute time of its steps (the step less the time it
waited for peers in the gradient all-reduce; :class:`~ringwright.world.MemberStats`)
exceeds the median of its peers' by the SchedulingPolicy's ``stragglers.factor``. In a
ring every member's whole step takes as long as the slowest one's, so only the compute
part tells the slow member from those waiting for it. Medians over the last steps make a
one-off pause one slow step among many; the ``windowSeconds`` a member must stay slow
make a slow minute cost nothing either.

The node a straggler ran on is avoided through a record in the job's status with an
expiry (``status.avoidedNodes``), not a taint: what made the member slow (a throttled GPU,
a bad NIC, a noisy neighbour) is this job's observation, other tenants keep the node,
and the operator needs no write access to nodes.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ringwright.objects import Obj
from ringwright.world import MemberStats, World

from ..api.conditions import parse_time
from ..api.models import AvoidedNode, SlowMember
from .placement.inventory import Inventory

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
class Verdict:
    """The slow members to keep watching, and those slow for the whole window."""

    watching: tuple[SlowMember, ...]
    stragglers: tuple[SlowMember, ...]


def judge(ratios: Mapping[str, float], nodes: Mapping[str, str],
          previous: Iterable[SlowMember], *, factor: float, window_s: float,
          now: float) -> Verdict:
    """Who is slow now (``ratios`` above ``factor``), since when (kept from
    ``previous`` while they stay slow), and who has been slow for ``window_s``."""
    since = {m.pod: m.since for m in previous}
    watching: list[SlowMember] = []
    stragglers: list[SlowMember] = []
    for pod, ratio in sorted(ratios.items()):
        if ratio < factor:
            continue
        member = SlowMember(pod=pod, node=nodes.get(pod, ""), since=since.get(pod, now),
                            ratio=round(ratio, 3))
        (stragglers if now - member.since >= window_s else watching).append(member)
    return Verdict(tuple(watching), tuple(stragglers))


def faster_without(ratio: float, size: int) -> bool:
    """Whether a ring of ``size`` members, one of them ``ratio`` times slower than the
    rest, makes more progress without it: ``size - 1`` members at full speed against
    ``size`` at the slow member's (data-parallel throughput grows with the members)."""
    return size > 1 and (size - 1) * ratio > size


def still_avoided(avoided: Iterable[AvoidedNode], now: float) -> list[AvoidedNode]:
    """The records of ``avoided`` that have not expired at ``now``."""
    return [a for a in avoided if (until := parse_time(a.until)) is not None and until > now]


def inventory_without(inventory: Inventory, nodes: Iterable[str]) -> Inventory:
    """``inventory`` less ``nodes`` (itself when there are none to leave out)."""
    away = set(nodes)
    if not away & set(inventory.by_name):
        return inventory
    return Inventory(n for n in inventory.nodes if n.name not in away)


def avoiding(fragment: Obj, nodes: Iterable[str]) -> Obj:
    """A placement fragment whose pod may not bind to any of ``nodes``: every required
    node-selector term gains ``metadata.name NotIn nodes`` (one such term when there was
    none)."""
    names = sorted(set(nodes))
    if not names:
        return fragment
    out = copy.deepcopy(fragment)
    node_affinity = out.setdefault("affinity", {}).setdefault("nodeAffinity", {})
    required = node_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.setdefault("nodeSelectorTerms", []) or [{}]
    away = {"key": "metadata.name", "operator": "NotIn", "values": names}
    required["nodeSelectorTerms"] = [
        {**term, "matchFields": [*term.get("matchFields", []), away]} for term in terms]
    return out
