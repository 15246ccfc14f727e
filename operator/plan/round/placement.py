"""Round steps that bring the pod count to the spec: gang withdrawal, resize, adding
pods (with the replacement backoff).
"""

from __future__ import annotations

import math

from ...api.conditions import parse_time
from ..isolation import harden
from ..manifests import PS, WORKER, pod
from ..nodeloss import with_node_loss_tolerations
from ..pods import PodState, PodView
from .state import RoundState
from .status import StatusChange


def backoff(restarts: int, base: float, cap: float) -> float:
    """Delay before the next replacement: base, 2·base, 4·base, … up to cap."""
    return float(min(cap, base * math.pow(2, max(restarts - 1, 0))))


class PlacementSteps(RoundState):
    """Scale down by rank, drain leavers, place and create what is missing."""

    def gang_withdrawn(self) -> bool:
        """Pods still unbound ``gangTimeoutSeconds`` after creation are deleted, all of them,
        so the next round places the gang again from what is free then."""
        assert self.obs.policy is not None
        limit = self.obs.policy.gang_timeout_seconds
        unbound = [p for p in self.workers + self.ps if p.state == PodState.PENDING
                   and not p.node and p.created is not None]
        if not unbound:
            return False
        oldest = min(p.created or self.now for p in unbound)
        if self.now - oldest < limit:
            self.plan.soon(oldest + limit - self.now)
            return False
        self.plan.delete.extend(p.name for p in unbound)
        self.event("GangTimeout", f"{len(unbound)} pods stayed unbound for {limit}s "
                   "(spec.gangTimeoutSeconds of the SchedulingPolicy); withdrawn, placing "
                   "again", warning=True)
        self.plan.soon(1.0)
        return True

    def resize(self) -> None:
        """Bring the worker (and ps) count to the spec: remove highest ranks, add lowest free."""
        if self.obs.policy is not None and self.gang_withdrawn():
            return
        wanted = self.spec.workers.replicas
        doomed = set(self.plan.delete)
        alive = [p for p in self.workers if p.alive and p.name not in doomed
                 and p.leaving_since is None]
        ranks = {m.pod: m.rank for m in self.obs.world.members} if self.obs.world else {}
        if len(alive) > wanted:
            # Pods outside the world hold no state: they go first, then the highest ranks.
            order = sorted(alive, key=lambda p: (p.name in ranks, ranks.get(p.name, 0), p.index))
            for p in order[wanted - len(alive):]:
                if p.name in ranks:
                    self.plan.mark_leaving.append(p.name)
                else:
                    self.plan.delete.append(p.name)
            self.event("ScalingDown", f"workers {len(alive)} -> {wanted}")
        for p in self.workers:
            if p.leaving_since is None or p.state == PodState.DELETING:
                continue
            drained = p.state in (PodState.SUCCEEDED, PodState.FAILED)
            if drained or self.now - p.leaving_since >= self.settings.drain_seconds:
                self.plan.delete.append(p.name)
            else:
                self.plan.soon(self.settings.drain_seconds - (self.now - p.leaving_since))
        missing_workers = wanted - len(alive)
        ps_alive = [p for p in self.ps if p.alive and p.name not in doomed]
        missing_ps = (self.spec.ps.replicas - len(ps_alive)) if self.spec.ps else 0
        if missing_workers > 0 or missing_ps > 0:
            self.add_pods(alive + ps_alive, missing_workers)

    def add_pods(self, live: list[PodView], missing_workers: int) -> None:
        if self.obs.policy is None:
            self.plan.soon(self.settings.resync_seconds)  # placed once the policy is fixed
            return
        hold = self.obs.hold_creates_until
        if hold is not None and self.now < hold:
            self.plan.soon(hold - self.now)  # a refused create waits out its backoff
            return
        last_failure = parse_time(self.status.last_failure_time)
        if last_failure is not None:
            ready_at = last_failure + backoff(self.status.restarts,
                                              self.settings.backoff_base_seconds,
                                              self.settings.backoff_cap_seconds)
            if self.now < ready_at:
                self.plan.soon(ready_at - self.now)
                return
        placed = self.placer(self.spec, self.obs.policy, self.obs.inventory, live)
        if placed.reason:
            # Gang rule and policy limits: nothing is created until all of it fits.
            self.condition("Schedulable", False, placed.reason, placed.message)
            if not self.workers:
                self.event(placed.reason, placed.message, warning=True)
            self.plan.soon(self.settings.resync_seconds)
            return
        if len(placed.workers) < missing_workers:
            self.condition("Schedulable", False, "InsufficientCapacity",
                           f"placed {len(placed.workers)} of {missing_workers} missing workers; "
                           "the rest are added when room frees up")
            self.plan.soon(self.settings.resync_seconds)
        else:
            self.condition("Schedulable", True, "Placed", placed.summary)
        # A pod on its way out leaves its index free: its replacement keeps the name (the
        # create is refused as AlreadyExists until the old pod is gone, then it goes through).
        for role, fragments, taken in (
            (WORKER, placed.workers, {p.index for p in self.workers
                                      if p.state != PodState.DELETING}),
            (PS, placed.ps, {p.index for p in self.ps if p.state != PodState.DELETING}),
        ):
            free = (i for i in range(len(taken) + len(fragments) + 1) if i not in taken)
            for fragment, index in zip(fragments, free, strict=False):
                self.plan.create.append(harden(self.job, pod(
                    self.job, role, index, with_node_loss_tolerations(
                        fragment, self.job["spec"], role == WORKER,
                        self.obs.policy.node_loss.toleration_seconds))))
        if placed.gpu_model:
            self.set(StatusChange(world=self.status.world.model_copy(
                update={"gpu_model": placed.gpu_model})))
