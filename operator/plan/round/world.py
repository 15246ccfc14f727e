"""The step that decides the next world, publishes it and mirrors it into the status."""

from __future__ import annotations

from ringwright.eviction import all_waiting, needs_new_generation
from ringwright.joining import ready_to_join
from ringwright.world import (
    CheckpointSettings,
    JobRef,
    LRScaling,
    Mode,
    ReportKind,
    TopologySettings,
    World,
)

from ...api.conditions import rfc3339
from ...api.models import (
    CheckpointSpec,
    JobPhase,
    LRScalingSpec,
    PendingMembership,
    RackMembers,
    TrainingJobStatus,
)
from ..health.recovery import recovery
from ..manifests import procs_per_pod
from ..pods import PodState, PodView
from ..servers import listed_servers, server_count
from ..worldplan import (
    Candidate,
    build_world,
    decide,
    membership_digest,
    ring_summary,
    world_digest,
)
from .lifecycle import below_min
from .state import Move, Outcome, Round, earliest, event, generation_after, merged, phase_after
from .status import StatusChange, WorldChange, world_changed

VERDICT_MARGIN_S = 2.0
"""Beyond failureDetectSeconds, how long a failed collective waits for a member's
heartbeat verdict before the operator re-forms the same membership."""


def world(r: Round, status: TrainingJobStatus, doomed: frozenset[str]) -> Outcome:
    """The next world from the ready pods, once their membership settled; the job's phase
    follows the world its pods follow.

    ``doomed``: the pods earlier steps delete or mark leaving. Sets: status.candidate, then
    what :func:`publish`, :func:`mirror` and :func:`below_min` set."""
    current = r.obs.world
    ready = [p for p in r.workers if p.state == PodState.READY and p.name not in doomed
             and p.leaving_since is None]
    if r.spec.mode == Mode.ALL_REDUCE:
        # A ring waits for each member at its next commit: a newcomer enters only once it
        # said it is ready to take part, so the members train on while its process starts.
        # (A PS job's workers do not wait for each other.)
        announced = set(ready_to_join(current, r.obs.reports, [p.name for p in ready],
                                      {p.name: p.uid for p in ready}))
        ready = [p for p in ready if p.name in announced]
    # Members waiting for a world that only a bump would bring: one restarted
    # without state, or a collective failed and no member was found dead.
    verdict_wait = r.spec.fault_tolerance.failure_detect_seconds + VERDICT_MARGIN_S
    force = current is not None and needs_new_generation(
        current, r.obs.reports, r.now, verdict_wait) is not None
    awaiting_verdict = current is not None and not force and any(
        rep.kind == ReportKind.COLLECTIVE_FAILED and rep.generation == current.generation
        and not rep.suspects for rep in r.obs.reports.values())
    seen = status.candidate
    pending = Candidate(seen.digest, seen.since) if seen and seen.digest else None
    up_ps = [p for p in r.ps if p.state == PodState.READY and p.name not in doomed]
    servers = server_count(r.spec.ps.replicas, current,
                           (p.index for p in up_ps)) if r.spec.ps else 0
    ready_ps = listed_servers(up_ps, servers)
    # A new server count is news even when the same pods are up (a server that was
    # down is taken away): the servers hand shards over when it changes.
    resized = current is not None and r.spec.ps is not None and current.ps_count != servers
    awaited = current is not None and all_waiting(
        current, r.obs.reports, [p.name for p in ready])
    go, candidate, wait = decide(
        current, ready, r.spec.workers.replicas, r.spec.workers.min, pending, r.now,
        r.settings.settle_seconds, force or resized, ready_ps, awaited)
    parts = [Outcome(
        status=StatusChange(candidate=PendingMembership(
            digest=candidate.digest, since=candidate.since) if candidate else None),
        requeue=earliest(wait, verdict_wait if awaiting_verdict else None))]
    if go:
        parts += publish(r, status, ready, ready_ps, servers)
    elif (current is not None and status.world.generation < current.generation
          and world_digest(current) == membership_digest([*ready, *ready_ps])):
        # The world went out but the status write after it did not (the operator
        # died, or the API server went away, in between): catch up with it.
        parts.append(mirror(r, status, current))
    parts.append(below_min(r, status, phase_after(status, parts), len(ready)))
    return merged(*parts)


def lr_settings(spec: LRScalingSpec) -> LRScaling:
    """The world's learning-rate rule from ``spec.lrScaling``.

    The API server requires ``baseWorldSize`` with ``linear`` and ``sqrt``; with
    ``none`` it is unused, and the world carries 1 for runtimes that require a number.
    """
    return LRScaling(rule=spec.rule, base_world_size=spec.base_world_size or 1,
                     warmup_steps=spec.warmup_steps)


def checkpoint_settings(spec: CheckpointSpec) -> CheckpointSettings:
    """The world's checkpoint settings from ``spec.checkpoint``; ``intervalSteps: Auto``
    goes out as ``intervalAuto`` with ``intervalSteps`` 0 (the runtime chooses)."""
    auto = spec.interval_steps == "Auto"
    return CheckpointSettings(
        path=spec.path, interval_steps=0 if auto else int(spec.interval_steps),
        interval_seconds=spec.interval_seconds, keep=spec.keep, interval_auto=auto,
        auto_min_steps=spec.auto_min_steps, auto_max_steps=spec.auto_max_steps)


def publish(r: Round, status: TrainingJobStatus, ready: list[PodView],
            ready_ps: list[PodView], servers: int) -> list[Outcome]:
    """A new world of the ready pods, at the next generation, written over the one read;
    ``servers``: the parameter servers it counts (:func:`..servers.server_count`).

    Sets: the plan's world, an event (and one when the server count changes); then what
    :func:`mirror` sets."""
    spec = r.spec
    generation = generation_after(r, status)
    new = build_world(
        JobRef(namespace=r.meta["namespace"], name=r.meta["name"], uid=r.meta.get("uid", "")),
        generation, ready, r.obs.world,
        r.obs.inventory.by_name,
        backend=spec.backend.value, mode=spec.mode.value,
        store_port=r.settings.store_port,
        lr=lr_settings(spec.lr_scaling),
        checkpoint=checkpoint_settings(spec.checkpoint),
        ps=ready_ps,
        ps_replicas=servers,
        local_ranks=procs_per_pod(r.job),
        topology=TopologySettings(
            hierarchical_all_reduce=spec.topology.hierarchical_all_reduce),
    )
    racks, edges, _ = ring_summary(new)
    told = [event("WorldPublished", f"generation {generation}: {_workers(new)} in {racks} "
                  f"racks ({edges} cross-rack ring edges)")]
    before = r.obs.world.ps_count if r.obs.world is not None else 0
    if spec.ps is not None and before and before != new.ps_count:
        told.append(event("ServersResized", f"generation {generation}: parameter servers "
                          f"{before} -> {new.ps_count} (spec.ps.replicas {spec.ps.replicas}); "
                          "their shards move to their new homes live"))
    published = Outcome(world=new, world_version=r.obs.world_version, events=tuple(told))
    return [published, mirror(r, status, new)]


def mirror(r: Round, status: TrainingJobStatus, followed: World) -> Outcome:
    """The job's phase and status follow ``followed``, the world its pods now follow.

    Sets: status.world, startTime (once), lastRecovery (once per loss), failuresSinceWhole
    (0 once ``followed`` holds every worker and parameter server); phase Running."""
    racks, edges, per_rack = ring_summary(followed)
    summary = WorldChange(
        generation=followed.generation, size=followed.size, racks=racks, cross_rack_edges=edges,
        rack_members=[RackMembers(rack=rack, members=n) for rack, n in per_rack],
        ps_servers=followed.ps_count if r.spec.ps else 0)
    models = {m.gpu_model for m in followed.members}
    if len(models) == 1 and "" not in models:
        # The model the members run on, not the one a placement last chose: a round that
        # read the pods index before it held this round's creates re-placed them on
        # another model (creates refused as AlreadyExists) and left that model here.
        summary["gpu_model"] = models.pop()
    change = StatusChange(world=world_changed(status.world, summary))
    moves: tuple[Move, ...] = ()
    if status.phase in (JobPhase.PENDING, JobPhase.RESTARTING):
        moves = (Move(JobPhase.RUNNING, "Running", f"world generation {followed.generation} has "
                      f"{_workers(followed)} (min {r.spec.workers.min})"),)
        if status.start_time is None:
            change["start_time"] = rfc3339(r.now)
    if (recovered := recovery(status, r.now)) is not None:
        change["last_recovery"] = recovered
    if status.failures_since_whole and len(followed.pods) >= r.spec.workers.replicas \
            and len(followed.ps) >= (r.spec.ps.replicas if r.spec.ps else 0):
        change["failures_since_whole"] = 0  # recovered: the next failure waits the base delay
    return Outcome(status=change, moves=moves)


def _workers(world: World) -> str:
    """The world's size in words: workers, and ranks when a pod holds several."""
    pods = len(world.pods)
    return f"{pods} workers" if pods == world.size else f"{pods} workers ({world.size} ranks)"
