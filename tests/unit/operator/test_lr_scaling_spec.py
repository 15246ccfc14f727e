"""spec.lrScaling: off unless asked for, and what the world tells the runtime."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ringwright.operator.api.models import LRScalingSpec, TrainingJob
from ringwright.operator.plan.round.world import lr_settings
from ringwright.world import LRRule, LRScaling

JOB = {
    "apiVersion": "ringwright.dev/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "demo"},
    "spec": {"workers": {"replicas": 8, "template": {"spec": {"containers": [
        {"name": "trainer", "image": "busybox"}]}}}},
}


def test_a_job_that_omits_lr_scaling_keeps_its_learning_rate() -> None:
    spec = TrainingJob.model_validate(JOB).spec.lr_scaling
    assert (spec.rule, spec.base_world_size) == (LRRule.NONE, None)
    world_lr = lr_settings(spec)
    assert world_lr.rule is LRRule.NONE
    # The runtime reading no lr at all follows the same default.
    assert LRScaling().rule is LRRule.NONE


@pytest.mark.parametrize("rule", [LRRule.LINEAR, LRRule.SQRT])
def test_an_explicit_rule_reaches_the_world_with_its_base(rule: LRRule) -> None:
    spec = LRScalingSpec.model_validate(
        {"rule": rule.value, "baseWorldSize": 4, "warmupSteps": 20})
    assert lr_settings(spec) == LRScaling(rule=rule, base_world_size=4, warmup_steps=20)


def test_base_world_size_is_at_least_one() -> None:
    with pytest.raises(ValidationError, match="baseWorldSize"):
        LRScalingSpec.model_validate({"rule": "linear", "baseWorldSize": 0})
