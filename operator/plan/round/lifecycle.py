"""Round steps that move the job through its lifecycle: finished, suspended, deadline,
completion, below the minimum.
"""

from __future__ import annotations

from ringwright.world import World

from ...api.conditions import parse_time, rfc3339
from ...api.models import CleanPodPolicy, ConditionStatus, JobPhase
from ..completion import completion
from ..pods import PodState
from .state import RoundState
from .status import StatusChange, find_condition


def empty_world(current: World, epoch: int) -> World:
    """``current`` at ``epoch`` with no members: everyone leaves (suspend)."""
    return current.model_copy(update={"epoch": epoch, "members": (), "ps": (),
                                      "store": current.store.model_copy(update={"address": ""})})


class LifecycleSteps(RoundState):
    """Suspend, deadline, completion and their consequences for the pods."""

    def finished(self) -> None:
        policy = self.spec.run_policy.clean_pod_policy
        for p in self.workers + self.ps:
            if p.state == PodState.DELETING:
                continue
            if policy == CleanPodPolicy.ALL or (policy == CleanPodPolicy.RUNNING and p.alive):
                self.plan.delete.append(p.name)
        ttl = self.spec.run_policy.ttl_seconds_after_finished
        done = parse_time(self.status.completion_time) or self.now
        if ttl is not None:
            if self.now >= done + ttl:
                self.plan.delete_job = True
            else:
                self.plan.soon(done + ttl - self.now)

    def suspended(self) -> None:
        """Members learn from an empty world that they are out, then their pods get their
        own grace period (SIGTERM: the final checkpoint is written). Nothing here is a
        failure: no member is lost, restarts and backoffLimit are untouched."""
        current = self.obs.world
        if current is not None and (current.members or current.ps):
            epoch = self.next_epoch()
            self.plan.world = empty_world(current, epoch)
            self.plan.world_version = self.obs.world_version
            self.set(StatusChange(world=self.status.world.model_copy(update={
                "epoch": epoch, "size": 0, "racks": 0, "cross_rack_edges": 0,
                "rack_members": []})))
            self.event("WorldPublished", f"epoch {epoch}: empty (suspended)")
        for p in self.workers + self.ps:
            if p.state != PodState.DELETING:
                self.plan.delete_gracefully.append(p.name)
        self.set(StatusChange(candidate=None, below_min_since=None))
        if self.phase != JobPhase.SUSPENDED:
            self.move(JobPhase.SUSPENDED, "Suspended", "spec.runPolicy.suspend is true; "
                      "pods stop with their grace period, restarts are kept")
        self.condition("Suspended", True, "Suspended", "pods deleted; the job is kept")

    def deadline_passed(self) -> bool:
        """activeDeadlineSeconds counts from the job's creation, through Pending and
        Suspended too: a job that never becomes schedulable still ends, and says why."""
        limit = self.spec.run_policy.active_deadline_seconds
        start = parse_time(self.meta.get("creationTimestamp")) or parse_time(
            self.status.start_time)
        if limit is None or start is None:
            return False
        if self.now - start < limit:
            self.plan.soon(start + limit - self.now)
            return False
        placed = find_condition(self.status, "Schedulable")
        if self.status.start_time is None and self.phase == JobPhase.PENDING:
            why = (f"{placed.reason}: {placed.message}" if placed is not None
                   and placed.status == ConditionStatus.FALSE
                   else "its pods never all became ready")
            self.move(JobPhase.FAILED, "NeverSchedulable",
                      f"not running {limit}s after creation "
                      f"(spec.runPolicy.activeDeadlineSeconds): {why}")
        else:
            self.move(JobPhase.FAILED, "DeadlineExceeded",
                      f"more than spec.runPolicy.activeDeadlineSeconds={limit} since creation")
        self.finished()
        return True

    def completed(self) -> bool:
        """The completion rule of the job's mode: True when the job just succeeded; sets
        ``finishing`` while the work is done but pods are still ending."""
        verdict = completion(self.spec.mode, self.obs.world, self.workers, self.ps,
                             parse_time(self.status.workers_finished_time), self.now,
                             self.settings.ps_exit_grace_seconds)
        if verdict.workers_finished_at is not None:
            self.set(StatusChange(workers_finished_time=rfc3339(verdict.workers_finished_at)))
        if verdict.wait is not None:
            self.plan.soon(verdict.wait)
        self.finishing = verdict.finishing
        if verdict.succeeded:
            self.move(JobPhase.SUCCEEDED, "Completed", verdict.message)
            self.finished()
        return verdict.succeeded

    def below_min(self, ready: int) -> None:
        since = parse_time(self.status.below_min_since)
        if since is None:
            since = self.now
            self.set(StatusChange(below_min_since=rfc3339(self.now)))
        if self.phase == JobPhase.RUNNING:
            self.move(JobPhase.RESTARTING, "BelowMinimum",
                      f"{ready} ready workers, below spec.workers.min="
                      f"{self.spec.workers.min}; waiting for replacements")
        grace = self.settings.below_min_grace_seconds
        if self.phase == JobPhase.RESTARTING and self.now - since >= grace:
            self.move(JobPhase.FAILED, "BelowMinimum",
                      f"fewer than spec.workers.min={self.spec.workers.min} workers for "
                      f"{grace:.0f}s")
            self.finished()
        else:
            self.plan.soon(max(grace - (self.now - since), 0.5))
