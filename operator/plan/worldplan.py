"""Deciding the next world: who is a member, in which order, and when to publish.

A burst of pod events must yield one generation, not one per event: a changed membership
is published only once it has been stable for the settle window, unless nothing more
is expected (every wanted worker is ready) or every member that stays stopped training
after a failure and waits for it: then waiting gains nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ringwright.world import (
    Backend,
    CheckpointSettings,
    JobRef,
    LRScaling,
    Member,
    Mode,
    StoreAddress,
    TopologySettings,
    World,
)

from .placement.inventory import NodeInfo
from .pods import PodView
from .ring import RingSlot, cross_rack_edges, order_ring


@dataclass(frozen=True)
class Candidate:
    """A membership seen but not yet published: its digest and since when it holds."""

    digest: str
    since: float


@dataclass(frozen=True)
class WorldDecision:
    """What to do about the world this round."""

    publish: World | None
    """A new world to publish now, or None."""
    candidate: Candidate | None
    """The pending membership to remember (None when published or unchanged)."""
    wait: float | None
    """Seconds until a pending membership may be published."""


def membership_digest(pods: Sequence[PodView]) -> str:
    """Identity of a membership: names, UIDs and IPs (a restarted pod is a new member)."""
    text = "|".join(sorted(f"{p.name}/{p.uid}/{p.ip}" for p in pods))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def world_digest(world: World) -> str:
    """The :func:`membership_digest` of a world's workers and parameter servers (each
    pod once, however many local ranks it holds)."""
    text = "|".join(sorted({f"{m.pod}/{m.pod_uid}/{m.ip}" for m in (*world.members, *world.ps)}))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build_world(
    job: JobRef,
    generation: int,
    members: Sequence[PodView],
    previous: World | None,
    nodes: Mapping[str, NodeInfo],
    *,
    backend: str,
    mode: str,
    store_port: int,
    lr: LRScaling,
    checkpoint: CheckpointSettings,
    ps: Sequence[PodView] = (),
    topology: TopologySettings | None = None,
    ps_replicas: int = 0,
    local_ranks: int = 1,
) -> World:
    """The world for ``members`` in ring order, survivors keeping their relative order.

    Each pod holds ``local_ranks`` consecutive ranks, so the ranks run in (rack, NVLink
    domain, node, pod, local rank) order and a pod's ranks sit next to each other.
    """

    def slot(p: PodView) -> RingSlot:
        node = nodes.get(p.node)
        return RingSlot(
            pod=p.name,
            rack=node.rack if node else "",
            nvlink_domain=node.nvlink_domain if node else "",
            node=p.node,
            index=p.index,
        )

    previous_order = list(previous.pods) if previous else []
    ordered = order_ring([slot(p) for p in members], previous_order)
    by_name = {p.name: p for p in members}

    def member(rank: int, p: PodView, local_rank: int = 0) -> Member:
        node = nodes.get(p.node)
        return Member(
            rank=rank, pod=p.name, local_rank=local_rank, pod_uid=p.uid, ip=p.ip, node=p.node,
            rack=node.rack if node else "",
            nvlink_domain=node.nvlink_domain if node else "",
            gpu_model=node.gpu_model if node else "", restarts=p.restarts,
        )

    ring = tuple(member(i * local_ranks + local, by_name[s.pod], local)
                 for i, s in enumerate(ordered) for local in range(local_ranks))
    # A PS keeps its pod index as its rank: shards are addressed by it.
    ps_members = tuple(member(p.index, p) for p in sorted(ps, key=lambda p: p.index))
    return World(
        job=job,
        generation=generation,
        backend=Backend(backend),
        mode=Mode(mode),
        store=StoreAddress(address=ring[0].ip if ring else "", port=store_port),
        members=ring,
        ps=ps_members,
        ps_replicas=ps_replicas,
        lr=lr,
        checkpoint=checkpoint,
        topology=topology or TopologySettings(),
    )


def decide(
    current: World | None,
    ready: Sequence[PodView],
    wanted: int,
    minimum: int,
    pending: Candidate | None,
    now: float,
    settle: float,
    force_bump: bool,
    ps: Sequence[PodView] = (),
    awaited: bool = False,
) -> tuple[bool, Candidate | None, float | None]:
    """Whether to publish ``ready`` as the next world now.

    Returns (publish, candidate to remember, seconds to wait). Nothing is published
    below ``minimum``. ``force_bump`` republishes the same membership under a new
    generation (members reported a broken collective or a restart without state). A change
    of the ready parameter servers ``ps`` is a membership change too. ``awaited``: every
    member in ``ready`` stopped training and waits for the next world (after a failure),
    so the settle window would only keep them all waiting.
    """
    if len(ready) < minimum:
        return False, None, None
    digest = membership_digest([*ready, *ps])
    if current is not None and world_digest(current) == digest:
        return force_bump, None, None
    if len(ready) >= wanted or awaited:
        return True, None, None
    if pending is None or pending.digest != digest:
        return False, Candidate(digest, now), settle
    if now - pending.since >= settle:
        return True, None, None
    return False, pending, settle - (now - pending.since)


def ring_summary(world: World) -> tuple[int, int, list[tuple[str, int]]]:
    """(racks used, ring edges crossing a rack boundary, members per rack in ring order)."""
    racks: list[tuple[str, int]] = []
    for m in world.members:
        if racks and racks[-1][0] == m.rack:
            racks[-1] = (m.rack, racks[-1][1] + 1)
        else:
            racks.append((m.rack, 1))
    distinct = len({m.rack for m in world.members})
    return distinct, cross_rack_edges([m.rack for m in world.members]), racks
