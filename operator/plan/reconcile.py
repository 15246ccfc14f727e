"""The pure heart of the operator: ``plan(observed, settings, now) -> Plan``.

No API calls, no clock, no globals: everything comes in as arguments and the result
is data (pods to create and delete, the next world, the next status, events). The
apply layer performs it; tests assert on it directly.
"""

from __future__ import annotations

from ..api.models import JobPhase
from ..settings import OperatorSettings
from .phases import TERMINAL
from .round.conditions import ConditionSteps
from .round.failures import FailureSteps
from .round.placement import PlacementSteps, backoff
from .round.world import WorldSteps
from .types import Event, Observed, Placement, Placer, Plan

# The types and backoff live beside the steps; importers keep reading them from here.
__all__ = ["Event", "Observed", "Placement", "Placer", "Plan", "backoff", "plan"]


class _Round(ConditionSteps, FailureSteps, PlacementSteps, WorldSteps):
    """One planning round: the steps of each phase (their own modules), in order."""

    def run(self) -> Plan:
        # They hold the names this job's pods need; not members, never counted.
        self.plan.delete_left_behind = [
            (p["metadata"]["name"], p["metadata"]["uid"]) for p in self.obs.left_behind
            if not p["metadata"].get("deletionTimestamp")]
        if self.phase in TERMINAL:
            self.finished()
            return self.finish()
        self.policy_condition()
        if self.deadline_passed():
            return self.finish()
        if self.obs.policy is not None and self.template_refused():
            return self.finish()
        if self.spec.run_policy.suspend:
            self.suspended()
            return self.finish()
        if self.phase == JobPhase.SUSPENDED:
            self.move(JobPhase.PENDING, "Resumed", "spec.runPolicy.suspend is false")
            self.condition("Suspended", False, "Resumed", "pods are recreated")
        if self.completed():
            return self.finish()
        self.failures()
        if self.phase in TERMINAL:
            return self.finish()
        self.crash_loops()
        self.checkpoints()
        if not self.finishing:
            self.resize()
            self.world()
        return self.finish()


def plan(observed: Observed, settings: OperatorSettings, now: float, placer: Placer) -> Plan:
    """Decide everything for one job from what was observed; performs nothing."""
    return _Round(observed, settings, now, placer).run()
