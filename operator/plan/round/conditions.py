"""Round steps that only report: the policy, template, crash-loop and checkpoint
conditions.
"""

from __future__ import annotations

from ...api.models import ConditionStatus
from ...api.templates_policy import TEMPLATE_CONDITION, job_violations
from ..checkpoint_condition import CONDITION as CHECKPOINT_CONDITION
from ..checkpoint_condition import checkpoint_condition
from ..nodeloss import CRASH_LOOP, crash_looping
from .state import RoundState
from .status import find_condition


class ConditionSteps(RoundState):
    """Conditions a user reads; template_refused also stops the round."""

    def policy_condition(self) -> None:
        """Say whether the policy is usable. Without it nothing new is placed, but the
        rest of the lifecycle (failures, suspend, deadline, completion) goes on."""
        name = self.spec.scheduling_policy_name
        if self.obs.policy is not None:
            self.condition("PolicyFound", True, "PolicyFound",
                           f"placing with SchedulingPolicy {name!r}")
        elif self.obs.policy_error:
            self.condition("PolicyFound", False, "PolicyInvalid",
                           f"SchedulingPolicy {name!r} is invalid: {self.obs.policy_error}")
        else:
            self.condition("PolicyFound", False, "PolicyNotFound",
                           f"SchedulingPolicy {name!r} does not exist; create it or set "
                           "spec.schedulingPolicyName to an existing policy")

    def template_refused(self) -> bool:
        """Refuse templates that ask for more than the policy allows: no pod is created."""
        assert self.obs.policy is not None
        found = job_violations(self.job["spec"], self.obs.policy.templates)
        name = self.spec.scheduling_policy_name
        if found:
            message = (f"SchedulingPolicy {name!r} does not allow: " + "; ".join(found)
                       + " (set the named spec.templates field of the policy, or remove "
                       "the field from the template)")
            self.condition(TEMPLATE_CONDITION, False, "TemplateRefused", message)
            self.event("TemplateRefused", message, warning=True)
            self.plan.soon(self.settings.resync_seconds)
            return True
        if find_condition(self.status, TEMPLATE_CONDITION) is not None:
            self.condition(TEMPLATE_CONDITION, True, "TemplateAllowed",
                           f"the templates are within SchedulingPolicy {name!r}")
        return False

    def crash_loops(self) -> None:
        """Pods whose containers wait in CrashLoopBackOff show as a condition."""
        looping = crash_looping(self.workers + self.ps)
        current = find_condition(self.status, CRASH_LOOP)
        if looping:
            message = f"{', '.join(looping)}: a container is waiting in {CRASH_LOOP}"
            if current is None or current.status != ConditionStatus.TRUE:
                self.event(CRASH_LOOP, message, warning=True)
            self.condition(CRASH_LOOP, True, CRASH_LOOP, message)
        elif current is not None:
            self.condition(CRASH_LOOP, False, "Running", "no container is in CrashLoopBackOff")

    def checkpoints(self) -> None:
        """Members' checkpoint-failure reports become the CheckpointFailing condition."""
        current = find_condition(self.status, CHECKPOINT_CONDITION)
        change = checkpoint_condition(self.obs.reports, current)
        if change is None:
            return
        if current is None or (current.status == ConditionStatus.TRUE) != change.failing:
            self.event(change.reason, change.message, warning=change.failing)
        self.condition(CHECKPOINT_CONDITION, change.failing, change.reason, change.message)
