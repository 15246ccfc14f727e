"""Learning-rate rescaling when the world size changes.

The learning rates a user gives the optimizer are meant for ``baseWorldSize``
workers. With ``linear`` the rate is multiplied by ``size / base`` (the global batch
grows with the world), with ``sqrt`` by its square root, with ``none`` it is left
alone. After a resize the factor can move from the old to the new value over
``warmupSteps`` steps instead of jumping, which keeps a large step-up from
destabilising training.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Protocol

from ringwright.world import LRRule, LRScaling

from .kvlog import log_event, runtime_logger

_log = runtime_logger("lr")


class HasParamGroups(Protocol):
    """Any torch optimizer (only its parameter groups are touched)."""

    param_groups: list[dict[str, Any]]


def scale_factor(rule: LRRule, size: int, base_world_size: int) -> float:
    """Multiplier on the base learning rate for a world of ``size`` workers."""
    ratio = size / base_world_size
    if rule is LRRule.LINEAR:
        return ratio
    if rule is LRRule.SQRT:
        return math.sqrt(ratio)
    return 1.0


class LRScaler:
    """Owns the ``lr`` of every parameter group: ``base lr x factor(world, step)``."""

    def __init__(self, optimizer: HasParamGroups) -> None:
        self._optimizer = optimizer
        self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        """The user's learning rates, meant for ``baseWorldSize`` workers."""
        self.settings = LRScaling()
        self.size = 0
        """World size the current factor targets; 0 before the first world."""
        self._from = 1.0
        self._to = 1.0
        self._start = 0

    def set_world(self, settings: LRScaling, size: int, step: int) -> None:
        """Retarget for a world of ``size`` workers, warming up from ``step`` on."""
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
                  lr=self.base_lrs[0] * target if self.base_lrs else 0.0)
        self.size = size
        self.apply(step)

    def factor(self, step: int) -> float:
        """The multiplier at ``step``: on the warmup ramp or at its target."""
        warmup = self.settings.warmup_steps
        if warmup == 0 or step >= self._start + warmup:
            return self._to
        done = max(step - self._start, 0) / warmup
        return self._from + (self._to - self._from) * done

    def apply(self, step: int) -> None:
        """Write ``base lr x factor(step)`` into every parameter group."""
        factor = self.factor(step)
        for group, base in zip(self._optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * factor

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue a warmup ramp on another member."""
        return {
            "base_lrs": list(self.base_lrs),
            "settings": self.settings.model_dump(mode="json", by_alias=True),
            "size": self.size,
            "from": self._from,
            "to": self._to,
            "start": self._start,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt a committed or broadcast ramp."""
        self.base_lrs = [float(lr) for lr in state["base_lrs"]]
        self.settings = LRScaling.model_validate(state["settings"])
        self.size = int(state["size"])
        self._from = float(state["from"])
        self._to = float(state["to"])
        self._start = int(state["start"])
