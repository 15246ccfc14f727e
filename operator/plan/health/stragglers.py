"""Members slow for good, in the job's status (pure): the rule itself is shared with
the local launcher (:mod:`ringwright.stragglers`); here it keeps its records in the
status and keeps new pods off the nodes stragglers ran on.

The node a straggler ran on is avoided through a record in the job's status with an
expiry (``status.avoidedNodes``), not a taint: what made the member slow (a throttled GPU,
a bad NIC, a noisy neighbour) is this job's observation, other tenants keep the node,
and the operator needs no write access to nodes.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ringwright.objects import Obj
from ringwright.stragglers import watch

from ...api.conditions import parse_time
from ...api.models import AvoidedNode, SlowMember
from ..placement.inventory import Inventory


@dataclass(frozen=True)
class Verdict:
    """The slow members to keep watching, and those slow for the whole window."""

    watching: tuple[SlowMember, ...]
    stragglers: tuple[SlowMember, ...]


def judge(ratios: Mapping[str, float], nodes: Mapping[str, str],
          previous: Iterable[SlowMember], *, factor: float, window_s: float,
          now: float) -> Verdict:
    """Who is slow now, since when (kept from ``previous`` while they stay slow), and
    who has been slow for ``window_s`` (:func:`ringwright.stragglers.watch`)."""
    seen = watch(ratios, {m.pod: m.since for m in previous}, factor=factor,
                 window_s=window_s, now=now)
    members = {pod: SlowMember(pod=pod, node=nodes.get(pod, ""), since=t,
                               ratio=round(ratios[pod], 3))
               for pod, t in sorted(seen.since.items())}
    return Verdict(tuple(m for pod, m in members.items() if pod not in seen.stragglers),
                   tuple(members[pod] for pod in seen.stragglers))


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
