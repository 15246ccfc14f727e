"""Server-side optimizers: the PS applies updates to the rows (or dense slices) it holds.

Each update works on a block of rows: ``param`` (rows x dim), ``grad`` of the same
shape, the optimizer ``state`` tensors of the same shape and, for Adam, a per-row step
count. A dense slice is one row. Embedding rows therefore keep their own Adam step,
so a rarely seen row gets the bias correction of its own few updates.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch


class OptimizerKind(StrEnum):
    SGD = "sgd"
    ADAGRAD = "adagrad"
    ADAM = "adam"


@dataclass(frozen=True)
class ServerOptimizer:
    """Which optimizer the PS runs, with its hyper-parameters."""

    kind: OptimizerKind = OptimizerKind.SGD
    lr: float = 0.01
    eps: float = 1e-10
    beta1: float = 0.9
    beta2: float = 0.999
    initial_accumulator: float = 0.0

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.eps <= 0:
            raise ValueError("lr and eps must be positive")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError("Adam betas must lie in [0, 1)")

    def to_json(self) -> dict[str, object]:
        return {"kind": self.kind.value, "lr": self.lr, "eps": self.eps, "beta1": self.beta1,
                "beta2": self.beta2, "initialAccumulator": self.initial_accumulator}

    @classmethod
    def from_json(cls, doc: dict[str, object]) -> ServerOptimizer:
        def num(key: str, default: float) -> float:
            value = doc.get(key, default)
            return float(value) if isinstance(value, int | float) else default

        return cls(OptimizerKind(str(doc.get("kind", "sgd"))), num("lr", 0.01),
                   num("eps", 1e-10), num("beta1", 0.9), num("beta2", 0.999),
                   num("initialAccumulator", 0.0))

    def state_names(self) -> tuple[str, ...]:
        """Names of the per-element state tensors this optimizer keeps."""
        if self.kind is OptimizerKind.ADAGRAD:
            return ("sum",)
        if self.kind is OptimizerKind.ADAM:
            return ("m", "v")
        return ()

    def new_state(self, like: torch.Tensor) -> dict[str, torch.Tensor]:
        """Fresh state for a block shaped like ``like``."""
        fill = self.initial_accumulator if self.kind is OptimizerKind.ADAGRAD else 0.0
        return {name: torch.full_like(like, fill) for name in self.state_names()}

    def apply(self, param: torch.Tensor, grad: torch.Tensor,
              state: dict[str, torch.Tensor], steps: torch.Tensor) -> None:
        """Update ``param`` in place from ``grad``; ``steps`` (one per row) counts updates.

        ``param``, ``grad`` and each state tensor are rows x dim; ``steps`` has one
        entry per row and is advanced here.
        """
        steps += 1
        if self.kind is OptimizerKind.SGD:
            param.add_(grad, alpha=-self.lr)
        elif self.kind is OptimizerKind.ADAGRAD:
            state["sum"].addcmul_(grad, grad)
            param.addcdiv_(grad, state["sum"].sqrt().add_(self.eps), value=-self.lr)
        else:
            m, v = state["m"], state["v"]
            m.mul_(self.beta1).add_(grad, alpha=1 - self.beta1)
            v.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
            t = steps.to(param.dtype).unsqueeze(1)
            bias1 = 1 - self.beta1 ** t
            bias2_sqrt = (1 - self.beta2 ** t).sqrt()
            denom = (v.sqrt() / bias2_sqrt).add_(self.eps)
            param.addcdiv_(m, denom * bias1, value=-self.lr)
