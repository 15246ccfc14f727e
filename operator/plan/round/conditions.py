"""Steps that only report: the policy, template, crash-loop and checkpoint conditions."""

from __future__ import annotations

from ...api.models import ConditionStatus, TrainingJobStatus
from ...api.schedulingpolicy import SchedulingPolicySpec
from ...api.templates_policy import TEMPLATE_CONDITION, job_violations
from ..health.checkpoints import CONDITION as CHECKPOINT_CONDITION
from ..health.checkpoints import checkpoint_condition
from ..health.nodeloss import CRASH_LOOP, crash_looping
from .state import NOTHING, Outcome, Round, SetCondition, event
from .status import find_condition


def policy_found(r: Round) -> Outcome:
    """Say whether the policy is usable. Without it nothing new is placed, but the rest of
    the lifecycle (failures, suspend, deadline, completion) goes on.

    Sets: condition PolicyFound."""
    name = r.spec.scheduling_policy_name
    if r.obs.policy is not None:
        found = SetCondition("PolicyFound", True, "PolicyFound",
                             f"placing with SchedulingPolicy {name!r}")
    elif r.obs.policy_error:
        found = SetCondition("PolicyFound", False, "PolicyInvalid",
                             f"SchedulingPolicy {name!r} is invalid: {r.obs.policy_error}")
    else:
        found = SetCondition("PolicyFound", False, "PolicyNotFound",
                             f"SchedulingPolicy {name!r} does not exist; create it or set "
                             "spec.schedulingPolicyName to an existing policy")
    return Outcome(conditions=(found,))


def templates(r: Round, policy: SchedulingPolicySpec, status: TrainingJobStatus) -> Outcome:
    """Refuse templates that ask for more than the policy allows: no pod is created.

    Sets: condition TemplateAllowed (False; True again only once it was False), an event.
    Stops the round when refused."""
    found = job_violations(r.job["spec"], policy.templates)
    name = r.spec.scheduling_policy_name
    if found:
        message = (f"SchedulingPolicy {name!r} does not allow: " + "; ".join(found)
                   + " (set the named spec.templates field of the policy, or remove "
                   "the field from the template)")
        return Outcome(
            conditions=(SetCondition(TEMPLATE_CONDITION, False, "TemplateRefused", message),),
            events=(event("TemplateRefused", message, warning=True),),
            requeue=r.settings.resync_seconds, stop=True)
    if find_condition(status, TEMPLATE_CONDITION) is None:
        return NOTHING
    return Outcome(conditions=(SetCondition(
        TEMPLATE_CONDITION, True, "TemplateAllowed",
        f"the templates are within SchedulingPolicy {name!r}"),))


def crash_loops(r: Round, status: TrainingJobStatus) -> Outcome:
    """Pods whose containers wait in CrashLoopBackOff show as a condition.

    Sets: condition CrashLoopBackOff, an event when it turns True."""
    looping = crash_looping(r.pods)
    current = find_condition(status, CRASH_LOOP)
    if looping:
        message = f"{', '.join(looping)}: a container is waiting in {CRASH_LOOP}"
        told = current is not None and current.status == ConditionStatus.TRUE
        return Outcome(conditions=(SetCondition(CRASH_LOOP, True, CRASH_LOOP, message),),
                       events=() if told else (event(CRASH_LOOP, message, warning=True),))
    if current is None:
        return NOTHING
    return Outcome(conditions=(SetCondition(CRASH_LOOP, False, "Running",
                                            "no container is in CrashLoopBackOff"),))


def checkpoints(r: Round, status: TrainingJobStatus) -> Outcome:
    """Members' checkpoint-failure reports become the CheckpointFailing condition.

    Sets: condition CheckpointFailing, an event when it flips."""
    current = find_condition(status, CHECKPOINT_CONDITION)
    change = checkpoint_condition(r.obs.reports, current)
    if change is None:
        return NOTHING
    flipped = current is None or (current.status == ConditionStatus.TRUE) != change.failing
    return Outcome(
        conditions=(SetCondition(CHECKPOINT_CONDITION, change.failing, change.reason,
                                 change.message),),
        events=(event(change.reason, change.message, warning=change.failing),)
        if flipped else ())
