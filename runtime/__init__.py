"""The in-container runtime that follows a job's world (no kopf, no operator code).

The user API, importable from here::

    from ringwright.runtime import ElasticRuntime, State, ElasticSampler, LRScaler

Its packages: :mod:`.checkpoint` (asynchronous, verified checkpoints),
:mod:`.collectives` (torch.distributed and Horovod behind one interface),
:mod:`.membership` (where the world comes from, who is alive, what a member reports),
:mod:`.local` (a launcher that stands in for the operator), :mod:`.ps` (parameter-server mode).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .elastic import ElasticRuntime, run
    from .lr_scaling import LRScaler
    from .sampler import ElasticSampler
    from .state import State

__all__ = ["ElasticRuntime", "ElasticSampler", "LRScaler", "State", "run"]

# Imported on first use, so `python -m ringwright.runtime.local.launcher` and the PS
# processes do not pay for torch before they need it.
_HOME = {"ElasticRuntime": ".elastic", "run": ".elastic", "ElasticSampler": ".sampler",
         "LRScaler": ".lr_scaling", "State": ".state"}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name], __name__), name)
