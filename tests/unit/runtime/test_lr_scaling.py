"""LR rescaling: linear / sqrt / none relative to baseWorldSize, warmup after a resize,
composed with the user's schedulers and per-group rates (multiplied, never overwritten)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import pytest
import torch
from torch.optim import lr_scheduler

from ringwright.runtime.local.launcher import lr_scaling
from ringwright.runtime.lr_scaling import LRScaler, scale_factor
from ringwright.world import LRRule, LRScaling

LINEAR4 = LRScaling(rule=LRRule.LINEAR, base_world_size=4)
NONE = LRScaling(rule=LRRule.NONE, base_world_size=4)


def optimizer(kind: str = "sgd") -> torch.optim.Optimizer:
    torch.manual_seed(0)
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    groups = [{"params": a.parameters(), "lr": 0.1}, {"params": b.parameters(), "lr": 0.01}]
    if kind == "adam":
        return torch.optim.Adam(groups)
    if kind == "plain-sgd":
        return torch.optim.SGD(groups)
    return torch.optim.SGD(groups, momentum=0.9)


def lrs(opt: torch.optim.Optimizer) -> list[float]:
    return [float(g["lr"]) for g in opt.param_groups]


def record_step_lrs(opt: torch.optim.Optimizer) -> list[list[float]]:
    """The rates each optimizer.step() runs with (a pre-hook registered after the scaler's)."""
    seen: list[list[float]] = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(lrs(o)))
    return seen


def one_step(opt: torch.optim.Optimizer) -> None:
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    opt.step()


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
def test_every_param_group_steps_with_its_rate_times_the_factor(kind: str) -> None:
    opt = optimizer(kind)
    scaler = LRScaler(opt)
    seen = record_step_lrs(opt)
    scaler.set_world(LRScaling(rule=LRRule.LINEAR, base_world_size=2, warmup_steps=5), 4, 0)
    one_step(opt)
    assert seen == [pytest.approx([0.2, 0.02])]
    assert lrs(opt) == [0.1, 0.01], "between steps the groups hold the user's rates, exactly"


def test_the_update_itself_uses_the_scaled_rate() -> None:
    opt = optimizer("plain-sgd")
    scaler = LRScaler(opt)
    scaler.set_world(LRScaling(rule=LRRule.LINEAR, base_world_size=2), 3, 0)
    before = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    one_step(opt)
    after = [p.detach() for g in opt.param_groups for p in g["params"]]
    moved = [float((b - a).flatten()[0]) for b, a in zip(before, after, strict=True)]
    assert moved == pytest.approx([0.15, 0.15, 0.015, 0.015])


def test_after_a_resize_the_factor_ramps_over_the_warmup_steps() -> None:
    scaler = LRScaler(optimizer())
    settings = LRScaling(rule=LRRule.LINEAR, base_world_size=1, warmup_steps=4)
    scaler.set_world(settings, 4, 0)
    scaler.set_world(settings, 2, 10)
    seen = []
    for step in range(10, 16):
        scaler.step = step
        seen.append(scaler.scaled_lrs()[0])
    assert seen == pytest.approx([0.4, 0.35, 0.3, 0.25, 0.2, 0.2])


def test_without_warmup_the_new_factor_applies_immediately() -> None:
    scaler = LRScaler(optimizer())
    settings = LRScaling(rule=LRRule.SQRT, base_world_size=1, warmup_steps=0)
    scaler.set_world(settings, 4, 0)
    scaler.set_world(settings, 9, 3)
    assert scaler.scaled_lrs() == pytest.approx([0.3, 0.03])


def test_a_resize_mid_ramp_starts_from_where_the_ramp_was() -> None:
    scaler = LRScaler(optimizer())
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
    copy = LRScaler(optimizer())
    copy.load_state_dict(source.state_dict())
    copy.step = 12
    assert copy.scaled_lrs()[0] == pytest.approx(0.3)
    assert copy.size == 2


def test_rescaling_is_logged_as_key_values(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ringwright.runtime")
    scaler = LRScaler(optimizer())
    scaler.set_world(LRScaling(rule=LRRule.SQRT, base_world_size=4), 16, 7)
    line = next(r.getMessage() for r in caplog.records if "lr_rescale" in r.getMessage())
    for part in ("world_size=16", "rule=sqrt", "base_world_size=4", "factor=2", "step=7",
                 f"lr={0.1 * math.sqrt(4):.6g}"):
        assert part in line


Scheduler = lr_scheduler.LRScheduler | lr_scheduler.ReduceLROnPlateau

SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Scheduler]] = {
    "StepLR": lambda o: lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
    "OneCycleLR": lambda o: lr_scheduler.OneCycleLR(o, max_lr=[0.4, 0.04], total_steps=30),
    "CosineAnnealingLR": lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=10),
    "LambdaLR": lambda o: lr_scheduler.LambdaLR(o, lambda step: 1 / (1 + step)),
    "SequentialLR": lambda o: lr_scheduler.SequentialLR(
        o, [lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=5),
            lr_scheduler.ExponentialLR(o, gamma=0.9)], milestones=[5]),
    "ReduceLROnPlateau": lambda o: lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=1),
}

WORLDS = {0: 4, 9: 3, 18: 4}
"""World size from a step on: 4 -> 3 -> 4, the issue's resize sequence."""
STEPS = 27


def run_schedule(name: str, settings: LRScaling | None) -> list[list[float]]:
    """The rates every step ran with; ``settings=None`` runs without the runtime."""
    opt = optimizer()
    scaler = LRScaler(opt) if settings is not None else None
    scheduler = SCHEDULERS[name](opt)
    seen = record_step_lrs(opt)
    for step in range(STEPS):
        if scaler is not None and settings is not None:
            if step in WORLDS:
                scaler.set_world(settings, WORLDS[step], step)
            scaler.step = step
        one_step(opt)
        if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
            scheduler.step(1.0)  # a loss that never improves: the rate halves repeatedly
        else:
            scheduler.step()
    return seen


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_rule_none_leaves_every_schedule_exactly_as_it_is(name: str) -> None:
    assert run_schedule(name, NONE) == run_schedule(name, None)


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_linear_rescale_across_4_3_4_is_schedule_times_factor_at_every_step(name: str) -> None:
    plain = run_schedule(name, None)
    scaled = run_schedule(name, LINEAR4)
    for step, (want, got) in enumerate(zip(plain, scaled, strict=True)):
        size = WORLDS[max(start for start in WORLDS if start <= step)]
        assert got == pytest.approx([lr * size / 4 for lr in want]), f"step {step}"
    assert len({round(lr[0], 9) for lr in plain}) > 2, "the schedule itself moved"


def test_the_local_launcher_reads_lr_scaling_as_the_api_server_does() -> None:
    assert lr_scaling(None, None, 0) == LRScaling(rule=LRRule.NONE)
    assert lr_scaling(None, 3, 5) == LRScaling(rule=LRRule.LINEAR, base_world_size=3,
                                                warmup_steps=5), "--base-world-size alone"
    assert lr_scaling("sqrt", 2, 0) == LRScaling(rule=LRRule.SQRT, base_world_size=2)
    for rule in ("linear", "sqrt"):
        with pytest.raises(ValueError, match="needs --base-world-size"):
            lr_scaling(rule, None, 0)
