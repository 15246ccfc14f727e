"""Round steps that decide the next world, publish it and mirror it into the status."""

from __future__ import annotations

from ringwright.eviction import all_waiting, needs_new_epoch
from ringwright.world import (
    CheckpointSettings,
    JobRef,
    LRScaling,
    ReportKind,
    TopologySettings,
    World,
)

from ...api.conditions import rfc3339
from ...api.models import JobPhase, PendingMembership, RackMembers
from ..pods import PodState, PodView
from ..recovery import recovery
from ..worldplan import (
    Candidate,
    build_world,
    decide,
    membership_digest,
    ring_summary,
    world_digest,
)
from .lifecycle import LifecycleSteps
from .status import StatusChange

VERDICT_MARGIN_S = 2.0
"""Beyond failureDetectSeconds, how long a failed collective waits for a member's
heartbeat verdict before the operator re-forms the same membership."""


class WorldSteps(LifecycleSteps):
    """The next world from the ready pods; the job's phase follows it."""

    def world(self) -> None:
        doomed = set(self.plan.delete) | set(self.plan.mark_leaving)
        ready = [p for p in self.workers if p.state == PodState.READY and p.name not in doomed
                 and p.leaving_since is None]
        current = self.obs.world
        # Members waiting for a world that only a bump would bring: one restarted
        # without state, or a collective failed and no member was found dead.
        verdict_wait = self.spec.fault_tolerance.failure_detect_seconds + VERDICT_MARGIN_S
        force = current is not None and needs_new_epoch(
            current, self.obs.reports, self.now, verdict_wait) is not None
        if current is not None and not force and any(
                r.kind == ReportKind.COLLECTIVE_FAILED and r.epoch == current.epoch
                and not r.suspects for r in self.obs.reports.values()):
            self.plan.soon(verdict_wait)
        seen = self.status.candidate
        pending = Candidate(seen.digest, seen.since) if seen and seen.digest else None
        ready_ps = [p for p in self.ps if p.state == PodState.READY and p.name not in doomed]
        awaited = current is not None and all_waiting(
            current, self.obs.reports, [p.name for p in ready])
        publish, candidate, wait = decide(
            current, ready, self.spec.workers.replicas, self.spec.workers.min, pending,
            self.now, self.settings.settle_seconds, force, ready_ps, awaited)
        self.set(StatusChange(candidate=PendingMembership(
            digest=candidate.digest, since=candidate.since) if candidate else None))
        if wait is not None:
            self.plan.soon(wait)
        if publish:
            self.publish(ready, ready_ps)
        elif (current is not None and self.status.world.epoch < current.epoch
              and world_digest(current) == membership_digest([*ready, *ready_ps])):
            # The world went out but the status write after it did not (the operator
            # died, or the API server went away, in between): catch up with it.
            self.mirror(current)
        running = self.phase in (JobPhase.RUNNING, JobPhase.RESTARTING)
        if running and len(ready) < self.spec.workers.min:
            self.below_min(len(ready))
        else:
            self.set(StatusChange(below_min_since=None))

    def publish(self, ready: list[PodView], ready_ps: list[PodView]) -> None:
        current = self.obs.world
        epoch = self.next_epoch()
        spec = self.spec
        world = build_world(
            JobRef(namespace=self.meta["namespace"], name=self.meta["name"],
                   uid=self.meta.get("uid", "")),
            epoch, ready, current,
            self.obs.inventory.by_name,
            backend=spec.backend.value, mode=spec.mode.value,
            store_port=self.settings.store_port,
            lr=LRScaling(rule=spec.lr_scaling.rule,
                         base_world_size=spec.lr_scaling.base_world_size,
                         warmup_steps=spec.lr_scaling.warmup_steps),
            checkpoint=CheckpointSettings(
                path=spec.checkpoint.path, interval_steps=spec.checkpoint.interval_steps,
                interval_seconds=spec.checkpoint.interval_seconds, keep=spec.checkpoint.keep),
            ps=ready_ps,
            ps_replicas=spec.ps.replicas if spec.ps else 0,
            topology=TopologySettings(
                hierarchical_all_reduce=spec.topology.hierarchical_all_reduce),
        )
        self.plan.world = world
        self.plan.world_version = self.obs.world_version
        racks, edges, _ = ring_summary(world)
        self.event("WorldPublished", f"epoch {epoch}: {world.size} workers in {racks} racks "
                   f"({edges} cross-rack ring edges)")
        self.mirror(world)

    def mirror(self, world: World) -> None:
        """The job's phase and status follow ``world``, the world its pods now follow."""
        racks, edges, per_rack = ring_summary(world)
        if self.phase in (JobPhase.PENDING, JobPhase.RESTARTING):
            self.move(JobPhase.RUNNING, "Running", f"world epoch {world.epoch} has "
                      f"{world.size} workers (min {self.spec.workers.min})")
            if self.status.start_time is None:
                self.set(StatusChange(start_time=rfc3339(self.now)))
        if (recovered := recovery(self.status, self.now)) is not None:
            self.set(StatusChange(last_recovery=recovered))
        self.set(StatusChange(world=self.status.world.model_copy(update={
            "epoch": world.epoch, "size": world.size, "racks": racks, "cross_rack_edges": edges,
            "rack_members": [RackMembers(rack=r, members=n) for r, n in per_rack]})))
