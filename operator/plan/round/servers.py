"""The step that takes away the PS pods a shrink of ``spec.ps.replicas`` left over:
they drain, then go (the rule is :mod:`..servers`)."""

from __future__ import annotations

from ..servers import PS_DRAIN_SECONDS, leaving_servers
from .state import NOTHING, Outcome, Round, event


def servers(r: Round, doomed: frozenset[str]) -> Outcome:
    """PS pods at or past ``spec.ps.replicas`` that serve in the world are marked leaving:
    the next world leaves them out, so they hand their shards over and exit 0; those that
    ended since are deleted, and so is one still there :data:`PS_DRAIN_SECONDS` later. A
    pod past the count that serves nothing is deleted at once.

    ``doomed``: the pods earlier steps already delete. Sets: the plan's mark_leaving and
    delete, an event for each."""
    if r.spec.ps is None:
        return NOTHING
    wanted = r.spec.ps.replicas
    fate = leaving_servers([p for p in r.ps if p.name not in doomed], wanted, r.obs.world,
                           r.now)
    told = []
    if fate.drain:
        told.append(event("ServerLeaving", f"{_names(fate.drain)}: past spec.ps.replicas="
                          f"{wanted}, handing shards over to the other servers, then exiting"))
    if fate.drained:
        told.append(event("ServerDrained", f"{_names(fate.drained)} left the servers and "
                          "ended; deleted"))
    if fate.timed_out:
        told.append(event("ServerDrainTimeout", f"{_names(fate.timed_out)} still running "
                          f"{PS_DRAIN_SECONDS:g}s after leaving the servers; deleted (a shard "
                          "not yet handed over fails over to its replica)", warning=True))
    if fate.unserved:
        told.append(event("ServerRemoved", f"{_names(fate.unserved)}: past spec.ps.replicas="
                          f"{wanted} and serving no shard; deleted"))
    return Outcome(mark_leaving=fate.drain,
                   delete=fate.drained + fate.timed_out + fate.unserved,
                   events=tuple(told), requeue=fate.wait)


def _names(pods: tuple[str, ...]) -> str:
    return ", ".join(pods)
