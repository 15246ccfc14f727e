"""``spec.checkpoint.intervalSteps`` as the world carries it: a number as is, Auto as
``intervalAuto`` with its bounds (the runtime chooses the steps)."""

from __future__ import annotations

from ringwright.operator.api.models import CheckpointSpec
from ringwright.operator.plan.round.world import checkpoint_settings


def test_a_number_goes_out_as_is() -> None:
    settings = checkpoint_settings(CheckpointSpec(path="/ckpt", interval_steps=50))
    assert (settings.interval_steps, settings.interval_auto) == (50, False)


def test_auto_goes_out_as_interval_auto_with_its_bounds() -> None:
    spec = CheckpointSpec.model_validate(
        {"path": "/ckpt", "intervalSteps": "Auto", "autoMinSteps": 20, "autoMaxSteps": 900})
    settings = checkpoint_settings(spec)
    assert settings.interval_auto
    assert settings.interval_steps == 0, "a runtime one version older takes no step interval"
    assert (settings.auto_min_steps, settings.auto_max_steps) == (20, 900)
