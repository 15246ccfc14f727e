"""A ParameterServer job's servers as ``spec.ps.replicas`` changes on a running job (pure).

The job's shards are fixed for its life; its servers grow and shrink under them, and the
servers hand shards over live (``runtime/ps/serving/moving.py``). They learn the new
server set from the world: ``psReplicas`` counts the servers, ``ps`` lists those up, by
index. So the operator decides two things here:

* **What the world counts and lists** (:func:`server_count`, :func:`listed_servers`). A
  shrink takes effect at once: the world counts the new number and leaves the servers at
  or past it out, which tells them to hand their shards over and exit. A grow takes effect
  server by server, as each new one is ready: a shard moves to its new home only once the
  home is up, so it keeps its primary and its replica where they are meanwhile (a world
  counting a server that is not up yet would move the replica there and leave the shard
  without one).
* **Which PS pods go, and when** (:func:`leaving_servers`). A PS pod at or past the new
  count that serves in the world drains: it is marked leaving (its exit 0 is then not
  the job's end nor a failure), hands everything over, exits 0 on its own and is deleted;
  or it is deleted after :data:`PS_DRAIN_SECONDS`. One that never served (not in the
  world) holds no shard and is deleted at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ringwright.world import World

from .pods import PodState, PodView

PS_DRAIN_SECONDS = 180.0
"""How long a PS pod taken away by a shrink may hand its shards over before it is deleted
anyway: the runtime gives up handing over after 120 s and exits; the rest is room for its
process to end and its pod to show it."""


def server_count(wanted: int, current: World | None, ready: Iterable[int]) -> int:
    """The servers the next world counts, for ``wanted`` (``spec.ps.replicas``).

    ``current``: the world published last; ``ready``: the indices of the ready PS pods
    the next world may list. A first world and a shrink count ``wanted``; a grow counts
    the current servers plus each next index, in order, whose pod is ready."""
    if current is None or current.ps_count == 0 or wanted <= current.ps_count:
        return wanted
    up = set(ready)
    count = current.ps_count
    while count < wanted and count in up:
        count += 1
    return count


def listed_servers(ready: Sequence[PodView], count: int) -> list[PodView]:
    """The ready PS pods a world of ``count`` servers lists: those below ``count``, in
    index order (a pod past it is leaving, or not counted yet)."""
    return sorted((p for p in ready if p.index < count), key=lambda p: p.index)


@dataclass(frozen=True)
class Leaving:
    """What happens to the PS pods a shrink took away, this round."""

    drain: tuple[str, ...] = ()
    """Mark leaving: they hand their shards over, then exit 0."""
    drained: tuple[str, ...] = ()
    """Delete: they ended after being marked leaving."""
    timed_out: tuple[str, ...] = ()
    """Delete: they did not end within :data:`PS_DRAIN_SECONDS`."""
    unserved: tuple[str, ...] = ()
    """Delete at once: past the count and never a server of the world (no shard)."""
    wait: float | None = None
    """Seconds until the first drain times out."""


def leaving_servers(ps: Sequence[PodView], wanted: int, current: World | None, now: float,
                    drain_s: float = PS_DRAIN_SECONDS) -> Leaving:
    """The fate of each PS pod at or past ``wanted``, and of each one that ended after it
    was marked leaving (its index may be wanted again: it must make room for a new pod).

    ``current``: the world published last (a pod it lists as a server holds shards)."""
    serving = {f"{m.pod}/{m.pod_uid}" for m in current.ps} if current else set()
    drain: list[str] = []
    drained: list[str] = []
    timed_out: list[str] = []
    unserved: list[str] = []
    waits: list[float] = []
    for p in sorted(ps, key=lambda p: p.index):
        if p.state == PodState.DELETING:
            continue
        if p.leaving_since is not None:
            if not p.alive:
                drained.append(p.name)
            elif p.index >= wanted:
                left = p.leaving_since + drain_s - now
                if left <= 0:
                    timed_out.append(p.name)
                else:
                    waits.append(left)
        elif p.index >= wanted:
            if p.alive and f"{p.name}/{p.uid}" in serving:
                drain.append(p.name)
                waits.append(drain_s)
            else:
                unserved.append(p.name)
    return Leaving(drain=tuple(drain), drained=tuple(drained), timed_out=tuple(timed_out),
                   unserved=tuple(unserved), wait=min(waits, default=None))
