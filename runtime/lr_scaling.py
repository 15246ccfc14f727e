"""Learning-rate rescaling when the world size changes, composed with the user's schedule.

The learning rates a user's optimizer and scheduler produce are meant for
``baseWorldSize`` workers. With ``linear`` the rate the optimizer *applies* is
multiplied by ``size / base`` (the global batch grows with the world), with ``sqrt``
by its square root, with ``none`` nothing changes. After a resize the factor can move
from the old to the new value over ``warmupSteps`` steps instead of jumping, which
keeps a large step-up from destabilising training.

The factor is applied only for the duration of ``optimizer.step()`` (a pre-hook
multiplies every group's ``lr``, a post-hook puts the exact previous values back). So
whatever sets ``lr`` between steps (StepLR, OneCycleLR, CosineAnnealingLR, LambdaLR,
SequentialLR, ReduceLROnPlateau, per-group rates, the user's own code) reads and writes
the unscaled schedule and is never overwritten; the update is ``schedule x factor``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ringwright.world import LRRule, LRScaling

from .kvlog import log_event, runtime_logger

_log = runtime_logger("lr")


class HookableOptimizer(Protocol):
    """Any torch optimizer: its parameter groups and its step hooks."""

    param_groups: list[dict[str, Any]]

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any: ...

    def register_step_post_hook(self, hook: Callable[..., Any]) -> Any: ...


def scale_factor(rule: LRRule, size: int, base_world_size: int) -> float:
    """Multiplier on the scheduled learning rate for a world of ``size`` workers."""
    ratio = size / base_world_size
    if rule is LRRule.LINEAR:
        return ratio
    if rule is LRRule.SQRT:
        return math.sqrt(ratio)
    return 1.0


class LRScaler:
    """Multiplies the ``lr`` of every parameter group by ``factor(world, step)`` while
    the optimizer steps, and only then."""

    def __init__(self, optimizer: HookableOptimizer) -> None:
        self._optimizer = optimizer
        self.settings = LRScaling()
        self.size = 0
        """World size the current factor targets; 0 before the first world."""
        self.step = 0
        """The global step the next ``optimizer.step()`` belongs to the ramp at."""
        self._from = 1.0
        self._to = 1.0
        self._start = 0
        self._saved: list[Any] | None = None
        optimizer.register_step_pre_hook(self._scale)
        optimizer.register_step_post_hook(self._unscale)

    def set_world(self, settings: LRScaling, size: int, step: int) -> None:
        """Retarget for a world of ``size`` workers, warming up from ``step`` on."""
        self.step = step
        if settings == self.settings and size == self.size:
            return
        target = scale_factor(settings.rule, size, settings.base_world_size)
        first = self.size == 0
        current = self.factor(step)
        self.settings = settings
        self._from = target if first or settings.warmup_steps == 0 else current
        self._to = target
        self._start = step
        log_event(_log, logging.INFO, "lr_rescale", world_size=size,
                  previous_world_size=self.size, rule=settings.rule.value,
                  base_world_size=settings.base_world_size, factor=target,
                  warmup_steps=settings.warmup_steps, step=step,
                  lr=self.scaled_lrs()[0] if self._optimizer.param_groups else 0.0)
        self.size = size

    def factor(self, step: int) -> float:
        """The multiplier at ``step``: on the warmup ramp or at its target."""
        warmup = self.settings.warmup_steps
        if warmup == 0 or step >= self._start + warmup:
            return self._to
        done = max(step - self._start, 0) / warmup
        return self._from + (self._to - self._from) * done

    def scaled_lrs(self) -> list[float]:
        """The rates the next ``optimizer.step()`` applies: schedule x factor, per group."""
        factor = self.factor(self.step)
        return [float(g["lr"]) * factor for g in self._optimizer.param_groups]

    def _scale(self, *_: object) -> None:
        factor = self.factor(self.step)
        if factor == 1.0:
            return
        groups = self._optimizer.param_groups
        self._saved = [_copy(g["lr"]) for g in groups]
        for group in groups:
            lr = group["lr"]
            if isinstance(lr, torch.Tensor):
                lr.mul_(factor)  # a tensor lr (capturable/fused) must stay the same object
            else:
                group["lr"] = lr * factor

    def _unscale(self, *_: object) -> None:
        saved, self._saved = self._saved, None
        if saved is None:
            return
        # The exact values from before the step, not a division: no drift in the schedule.
        for group, lr in zip(self._optimizer.param_groups, saved, strict=True):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].copy_(lr)
            else:
                group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue a warmup ramp on another member."""
        return {
            "settings": self.settings.model_dump(mode="json", by_alias=True),
            "size": self.size,
            "from": self._from,
            "to": self._to,
            "start": self._start,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt a committed or broadcast ramp."""
        self.settings = LRScaling.model_validate(state["settings"])
        self.size = int(state["size"])
        self._from = float(state["from"])
        self._to = float(state["to"])
        self._start = int(state["start"])


def _copy(lr: Any) -> Any:
    return lr.clone() if isinstance(lr, torch.Tensor) else lr
