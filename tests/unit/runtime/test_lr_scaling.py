"""LR rescaling: linear / sqrt / none relative to baseWorldSize, warmup after a resize,
every param group of any optimizer, visible in the logs."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from ringwright.runtime.lr_scaling import LRScaler, scale_factor
from ringwright.world import LRRule, LRScaling


def optimizer(kind: str = "sgd") -> torch.optim.Optimizer:
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    groups = [{"params": a.parameters(), "lr": 0.1}, {"params": b.parameters(), "lr": 0.01}]
    if kind == "adam":
        return torch.optim.Adam(groups)
    return torch.optim.SGD(groups, momentum=0.9)


def lrs(opt: torch.optim.Optimizer) -> list[float]:
    return [float(g["lr"]) for g in opt.param_groups]


@pytest.mark.parametrize(
    ("rule", "size", "base", "factor"),
    [
        (LRRule.LINEAR, 4, 2, 2.0),
        (LRRule.LINEAR, 3, 4, 0.75),
        (LRRule.SQRT, 8, 2, 2.0),
        (LRRule.SQRT, 2, 8, 0.5),
        (LRRule.NONE, 8, 2, 1.0),
    ],
)
def test_scale_factor(rule: LRRule, size: int, base: int, factor: float) -> None:
    assert scale_factor(rule, size, base) == pytest.approx(factor)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_every_param_group_is_scaled_at_once_in_the_first_world(kind: str) -> None:
    opt = optimizer(kind)
    scaler = LRScaler(opt)
    scaler.set_world(LRScaling(rule=LRRule.LINEAR, base_world_size=2, warmup_steps=5), 4, 0)
    assert lrs(opt) == pytest.approx([0.2, 0.02])


def test_after_a_resize_the_factor_ramps_over_the_warmup_steps() -> None:
    opt = optimizer()
    scaler = LRScaler(opt)
    settings = LRScaling(rule=LRRule.LINEAR, base_world_size=1, warmup_steps=4)
    scaler.set_world(settings, 4, 0)
    scaler.set_world(settings, 2, 10)
    seen = []
    for step in range(10, 16):
        scaler.apply(step)
        seen.append(lrs(opt)[0])
    assert seen == pytest.approx([0.4, 0.35, 0.3, 0.25, 0.2, 0.2])


def test_without_warmup_the_new_factor_applies_immediately() -> None:
    opt = optimizer()
    scaler = LRScaler(opt)
    settings = LRScaling(rule=LRRule.SQRT, base_world_size=1, warmup_steps=0)
    scaler.set_world(settings, 4, 0)
    scaler.set_world(settings, 9, 3)
    assert lrs(opt) == pytest.approx([0.3, 0.03])


def test_a_resize_mid_ramp_starts_from_where_the_ramp_was() -> None:
    opt = optimizer()
    scaler = LRScaler(opt)
    settings = LRScaling(rule=LRRule.LINEAR, base_world_size=1, warmup_steps=4)
    scaler.set_world(settings, 4, 0)
    scaler.set_world(settings, 2, 10)  # ramp 4 -> 2
    scaler.set_world(settings, 6, 12)  # at step 12 the factor was 3
    assert scaler.factor(12) == pytest.approx(3.0)
    assert scaler.factor(16) == pytest.approx(6.0)


def test_the_ramp_survives_a_state_dict_round_trip() -> None:
    settings = LRScaling(rule=LRRule.LINEAR, base_world_size=1, warmup_steps=4)
    source = LRScaler(optimizer())
    source.set_world(settings, 4, 0)
    source.set_world(settings, 2, 10)
    opt = optimizer()
    copy = LRScaler(opt)
    copy.load_state_dict(source.state_dict())
    copy.apply(12)
    assert lrs(opt)[0] == pytest.approx(0.3)
    assert copy.size == 2


def test_rescaling_is_logged_as_key_values(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ringwright.runtime")
    scaler = LRScaler(optimizer())
    scaler.set_world(LRScaling(rule=LRRule.SQRT, base_world_size=4), 16, 7)
    line = next(r.getMessage() for r in caplog.records if "lr_rescale" in r.getMessage())
    for part in ("world_size=16", "rule=sqrt", "base_world_size=4", "factor=2", "step=7",
                 f"lr={0.1 * math.sqrt(4):.6g}"):
        assert part in line
