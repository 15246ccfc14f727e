"""The pure heart of the operator: ``plan(observed, settings, now) -> Plan``.

No API calls, no clock, no globals: everything comes in as arguments and the result
is data (pods to create and delete, the next world, the next status, events). The
apply layer performs it; tests assert on it directly.

A round is a list of steps (:mod:`.round`), each a function of what it reads that returns
what it decides; the draft records their outcomes in this order.
"""

from __future__ import annotations

from dataclasses import replace

from ..settings import OperatorSettings
from .kueue import (
    Admission,
    admission,
    capped_placer,
    dropped_topology,
    effective_job,
    queue_name,
    requeue_evicted,
    resize_queued,
    resize_slices,
    topology_fits,
    workload,
)
from .phases import TERMINAL
from .round.conditions import checkpoints, crash_loops, policy_found, templates
from .round.counts import counts
from .round.draft import Draft
from .round.failures import failures
from .round.lifecycle import (
    clean_up,
    completed,
    deadline,
    left_behind,
    resumption,
    suspension,
)
from .round.measures import measurements, stragglers
from .round.placement import backoff, gang_timeout, resize
from .round.queue import queue, quota_wait, topology_dropped, topology_fixed
from .round.state import Round
from .round.world import world
from .types import Event, Observed, Placement, Placer, Plan

# The types and backoff live beside the steps; importers keep reading them from here.
__all__ = ["Event", "Observed", "Placement", "Placer", "Plan", "backoff", "plan"]


def plan(observed: Observed, settings: OperatorSettings, now: float, placer: Placer) -> Plan:
    """Decide everything for one job from what was observed; performs nothing."""
    r = Round.of(observed, settings, now, placer)
    d = Draft.of(r)
    d.take(left_behind(r))
    if d.phase in TERMINAL:
        return _close(r, d)
    d.take(policy_found(r))
    if d.take(deadline(r, d.status)).stop:
        return _close(r, d)
    if observed.policy is not None and d.take(templates(r, observed.policy, d.status)).stop:
        return _close(r, d)
    if r.spec.run_policy.suspend:
        d.take(suspension(r, d.status))
        return _close(r, d)
    # With the integration off the label is Kueue's business only (as for a cluster
    # without Kueue): the job runs as any other.
    queued = queue_name(observed.job) if settings.kueue else None
    if queued is not None:
        # Kueue decides whether and how much may run; its flavor and count make the
        # effective spec every later step places from.
        given = admission(observed.workload)
        if observed.workload is None and observed.policy is not None:
            published = workload(observed.job, queued, observed.policy,
                                 observed.workload_priority, elastic=settings.kueue_elastic)
            if isinstance(published, Admission):
                given = published  # it cannot be published yet: say why
            else:
                d.plan.workload = published
        if d.take(queue(r, d.status, given)).stop:
            if observed.workload is not None:
                if not r.pods:
                    d.plan.workload_requeue = requeue_evicted(observed.workload, now)
                d.plan.workload_resize = resize_queued(observed.job, observed.workload)
            if observed.waiting_slice is not None:  # one request at a time, once admitted
                d.plan.workload_delete.append(observed.waiting_slice["metadata"]["name"])
            return _close(r, d)
        keep: int | None = None
        if settings.kueue_elastic and observed.workload is not None:
            change = resize_slices(observed.job, observed.workload, observed.waiting_slice,
                                   given, observed.next_slice,
                                   topology_slices=settings.kueue_elastic_topology)
            d.plan.workload = change.create
            d.plan.workload_delete.extend(change.delete)
            d.plan.workload_resize = change.resize
            d.take(quota_wait(d.status, change.waiting))
            d.take(topology_fixed(d.status, change.fixed))
            keep = change.keep
        if observed.workload is not None:
            d.take(topology_dropped(d.status, dropped_topology(observed.workload, given)))
        # The running pods against the domains Kueue counted: new pods go where there
        # is room, and the pods it no longer counts are the first to leave.
        inventory = observed.inventory
        ranks = {m.pod: m.rank for m in observed.world.members} if observed.world else {}
        fits = topology_fits(given, r.pods, ranks, lambda node: dict(n.labels) if (
            n := inventory.node(node)) is not None else None)
        effective = replace(
            observed, job=effective_job(observed.job, given, observed.flavor_labels, fits, keep),
            topology_surplus=frozenset().union(*(f.surplus for f in fits.values())))
        r = Round.of(effective, settings, now, capped_placer(placer, fits))
    d.take(resumption(d.status))
    if d.take(completed(r, d.status)).stop:
        return _close(r, d)
    if d.take(failures(r, d.status)).stop:
        return _close(r, d)
    d.take(crash_loops(r, d.status))
    d.take(checkpoints(r, d.status))
    d.take(measurements(r, d.status))
    if not d.finishing:
        if observed.policy is not None:
            d.take(stragglers(r, observed.policy, d.status, frozenset(d.plan.delete)))
        if observed.policy is None or not d.take(gang_timeout(r, observed.policy)).stop:
            d.take(resize(r, d.status, doomed=frozenset(d.plan.delete)))
        d.take(world(r, d.status, doomed=frozenset(
            d.plan.delete + d.plan.mark_leaving + d.out_of_world)))
    return _close(r, d)


def _close(r: Round, d: Draft) -> Plan:
    """End the round: a finished job's clean-up, then the counts every status carries."""
    if d.phase in TERMINAL:
        d.take(clean_up(r, d.status))
        if r.obs.workload is not None and not admission(r.obs.workload).finished:
            d.plan.workload_finished = f"TrainingJob {d.phase}"
            d.plan.finish_workloads = [wl["metadata"]["name"] for wl in
                                       (r.obs.workload, r.obs.waiting_slice) if wl is not None]
    d.take(counts(r, d.plan))
    return d.done()
