"""The round step that counts failures and deletes the failed, within backoffLimit."""

from __future__ import annotations

from ringwright.eviction import judge
from ringwright.world import ReportKind

from ...api.conditions import rfc3339
from ...api.models import JobPhase
from ...api.schedulingpolicy import SchedulingPolicySpec
from ..nodeloss import lost_members, new_container_restarts
from ..pods import PodState
from .lifecycle import LifecycleSteps
from .status import StatusChange


class FailureSteps(LifecycleSteps):
    """Lost pods and members, counted once each; too many end the job."""

    def failures(self) -> None:
        """Failed pods and members that vanished are replaced within backoffLimit.

        Pods are tracked as ``name/uid``: a replacement reuses its predecessor's name.
        """
        world = self.obs.world
        members = {f"{m.pod}/{m.pod_uid}" for m in world.members} if world else set()
        everyone = self.workers + self.ps
        present = {f"{p.name}/{p.uid}": p for p in everyone}
        lost = [key for key, p in present.items() if p.state == PodState.FAILED]
        lost += sorted(members - present.keys())
        if world is not None:
            # Peers' word, corroborated: several reporters, or one and the pod not Ready.
            unhealthy = {p.name for p in everyone if p.state != PodState.READY}
            for e in judge(world, self.obs.reports, unhealthy):
                pod_ = next((p for p in everyone if p.name == e.pod), None)
                if pod_ is not None and pod_.state != PodState.DELETING:
                    lost.append(f"{pod_.name}/{pod_.uid}")
                    self.event("MemberDead", f"{e.pod} is dead: {e.reason} "
                               f"({', '.join(e.reporters)}); replacing it", warning=True)
        for name, report in self.obs.reports.items():
            pod_ = next((p for p in everyone if p.name == name), None)
            if (report.kind == ReportKind.STALLED and world is not None
                    and report.epoch == world.epoch and pod_ is not None
                    and pod_.state != PodState.DELETING):
                lost.append(f"{pod_.name}/{pod_.uid}")
                self.plan.clear_reports.append(name)
                self.event("MemberStalled",
                           f"{name} reports its training loop stalled; replacing it",
                           warning=True)
        # Without a usable policy losses still count, with the default thresholds.
        node_loss = (self.obs.policy or SchedulingPolicySpec()).node_loss
        losses, next_at = lost_members(everyone, self.obs.node_down_since,
                                       node_loss.unready_seconds, self.now)
        for loss in losses:
            lost.append(f"{loss.pod.name}/{loss.pod.uid}")
            self.event(loss.reason, f"{loss.message}; replacing it", warning=True)
        if next_at is not None:
            self.plan.soon(next_at - self.now)
        crashed, counted = new_container_restarts(everyone, self.status.container_restarts)
        known = set(self.status.lost_pods)
        fresh = [key for key in dict.fromkeys(lost) if key not in known]
        # Remember what was counted while it is still visible, so each loss counts once.
        self.set(StatusChange(
            container_restarts=counted,
            lost_pods=sorted((known | set(fresh)) & (present.keys() | members))))
        for key in dict.fromkeys(lost):
            p = present.get(key)
            if p is not None and p.state != PodState.DELETING:
                self.plan.delete.append(p.name)
        if not fresh and not crashed:
            return
        restarts = self.status.restarts + len(fresh) + sum(crashed.values())
        self.set(StatusChange(restarts=restarts, last_failure_time=rfc3339(self.now)))
        limit = self.spec.run_policy.backoff_limit
        if fresh:
            names = ", ".join(key.split("/")[0] for key in fresh)
            self.event("MemberLost", f"lost {names} (restart {restarts} of backoffLimit "
                       f"{limit})", warning=True)
        if crashed:
            names = ", ".join(f"{key.split('/')[0]} ({n})" for key, n in crashed.items())
            self.event("ContainerRestarted", f"containers restarted in {names} (restart "
                       f"{restarts} of backoffLimit {limit})", warning=True)
        if restarts > limit:
            self.move(JobPhase.FAILED, "BackoffLimitExceeded",
                      f"{restarts} pod failures exceed spec.runPolicy.backoffLimit={limit}")
            self.finished()
