"""Random-number generator states as part of the training state.

Dropout masks, data augmentation and sampling draw from four generators: Python's
``random``, NumPy's global one, torch's CPU generator and one torch generator per CUDA
device. :class:`RNGState` reads and writes all four as one state dict of plain values
and tensors, so the training state can commit, roll back, broadcast and checkpoint them
like any other object.

Two semantics (``State(rng=...)``):

``shared`` (the default)
    Every rank holds the same generator states: they are committed, rolled back, sent
    to newcomers by the sync and checkpointed. All ranks draw the same numbers (the
    same dropout mask on different samples). Replaying from a commit, in the same
    worlds, reproduces every draw.
``per_rank``
    Each rank draws its own stream. Whenever a world forms (and on a rollback) every
    rank reseeds from ``(seed, step, rank, size)``, so a rank's draws depend only on the job's
    seed, the step the world formed at and the rank, and a replay from a commit in the
    same worlds reproduces them. A rank's stream is not carried to another rank or
    world: after a resize, ranks start fresh streams.
"""

from __future__ import annotations

import hashlib
import random
from enum import StrEnum
from typing import Any

import numpy
import torch


class RNGMode(StrEnum):
    """How the generator states relate across ranks; see the module documentation."""

    SHARED = "shared"
    PER_RANK = "per_rank"


def derived_seed(seed: int, step: int, rank: int, size: int) -> int:
    """A 63-bit seed for ``rank`` of ``size`` in a world formed at ``step`` (or rolled back
    to it): the same on any machine."""
    digest = hashlib.sha256(f"ringwright-rng:{seed}:{step}:{rank}:{size}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class RNGState:
    """The process's generators (Python, NumPy, torch CPU, CUDA) as one stateful object."""

    def state_dict(self) -> dict[str, Any]:
        """Every generator's state as plain values and CPU tensors (a private copy)."""
        np_state = numpy.random.get_state(legacy=False)
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": {
                "key": np_state["state"]["key"].tolist(),
                "pos": int(np_state["state"]["pos"]),
                "has_gauss": int(np_state["has_gauss"]),
                "gauss": float(np_state["gauss"]),
            },
            "torch": torch.get_rng_state(),
        }
        # Reading CUDA states would initialise CUDA in a process that never used it.
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set every generator to ``state`` (CUDA ones only where CUDA is usable)."""
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        np = state["numpy"]
        numpy.random.set_state(("MT19937", numpy.array(np["key"], dtype=numpy.uint32),
                                np["pos"], np["has_gauss"], np["gauss"]))
        torch.set_rng_state(state["torch"].to(torch.uint8))
        cuda = state.get("cuda")
        if cuda and torch.cuda.is_available():
            count = min(len(cuda), torch.cuda.device_count())
            for device in range(count):
                torch.cuda.set_rng_state(cuda[device].to(torch.uint8), device)

    def seed(self, seed: int) -> None:
        """Seed every generator from one number (the ``per_rank`` reseed)."""
        random.seed(seed)
        numpy.random.seed(seed % 2**32)
        torch.manual_seed(seed)  # seeds the CPU generator and every CUDA device's
