"""Moving a training state between members as tensors, and deciding when not to.

A state payload (nested dicts, lists and tuples of tensors and plain values) is split
into a *skeleton*, in which every tensor is replaced by a :class:`TensorSlot` naming
its dtype and shape, and the list of its tensors. The skeleton is small (step counts,
hyperparameters, sampler cursor, generator states) and travels as one pickled object;
the tensors (model, optimizer moments, ...) travel by tensor broadcast, one flat buffer
per dtype, without ever being pickled.

:func:`shared_commit` decides, from what every member of a new world says about
itself, whether they all already hold the same commit, in which case nothing needs to
move at all (a planned scale-down, or survivors of a failure that all rolled back to
the same commit); :func:`needs_state`, which members lack the source's commit: on a
join the members that hold it take part in the broadcast with their own tensors and
neither load the state nor copy it again.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .collectives.backend import CollectiveBackend
from .collectives.group import MemberInfo


@dataclass(frozen=True)
class TensorSlot:
    """Where a tensor was in a payload: its position in the tensor list and its form."""

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    accelerator: bool
    """The sender held it on an accelerator: receivers allocate it on theirs."""


def split_tensors(payload: Any) -> tuple[Any, list[torch.Tensor]]:
    """``payload`` with every tensor replaced by a :class:`TensorSlot`, and the tensors."""
    tensors: list[torch.Tensor] = []

    def walk(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj.detach())
            return TensorSlot(len(tensors) - 1, obj.dtype, tuple(obj.shape),
                              obj.device.type != "cpu")
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(walk(v) for v in obj)
        return obj

    return walk(payload), tensors


def empty_tensors(skeleton: Any, device: torch.device) -> list[torch.Tensor]:
    """Uninitialised tensors for every slot of ``skeleton``, in slot order."""
    slots: list[TensorSlot] = []

    def walk(obj: Any) -> None:
        if isinstance(obj, TensorSlot):
            slots.append(obj)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, list | tuple):
            for v in obj:
                walk(v)

    walk(skeleton)
    slots.sort(key=lambda s: s.index)
    cpu = torch.device("cpu")
    return [torch.empty(s.shape, dtype=s.dtype, device=device if s.accelerator else cpu)
            for s in slots]


def join_tensors(skeleton: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """The payload that ``skeleton`` describes, with ``tensors`` put back in their slots."""
    if isinstance(skeleton, TensorSlot):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        return {k: join_tensors(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [join_tensors(v, tensors) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(join_tensors(v, tensors) for v in skeleton)
    return skeleton


def broadcast_payload(backend: CollectiveBackend, payload: dict[str, Any] | None, src: int,
                      rank: int, receivers: Sequence[int] | None = None
                      ) -> tuple[dict[str, Any], int]:
    """``src``'s payload on every rank, and the bytes that moved here.

    ``receivers``: the ranks that lack it (None: every rank but ``src``). ``payload`` is
    read on ``src`` and on the other ranks that are no receivers, which hold the same
    state and get their own payload back; its tensors take part in the broadcast where
    they are (overwritten with the values they hold). Receivers get fresh tensors that
    nothing else references.
    """
    holds = rank == src or (receivers is not None and rank not in receivers)
    if holds:
        if payload is None:
            raise ValueError("a member that holds the state to sync must give its payload")
        skeleton, tensors = split_tensors(payload)
    else:
        skeleton, tensors = None, []
    skeleton = backend.broadcast_object(skeleton if rank == src else None, src)
    if not holds:
        tensors = empty_tensors(skeleton, backend.device)
    # A collective even when few receive: it fails at once when the group is aborted
    # (a dead source), where gloo leaves a point-to-point receive waiting.
    backend.broadcast_tensors(tensors, src)
    moved = len(pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL))
    if rank == src or not holds:
        moved += sum(t.numel() * t.element_size() for t in tensors)
    if holds and payload is not None:
        return payload, moved
    return join_tensors(skeleton, tensors), moved


def needs_state(infos: Sequence[MemberInfo], src: int) -> list[int] | None:
    """The ranks that lack rank ``src``'s commit and must receive it; None when all the
    others do (a fresh start), for one broadcast to all.

    A member holds the source's commit on the terms of :func:`shared_commit`: synced in
    the same world, at the same committed step.
    """
    source = infos[src]
    lacking = [i for i, info in enumerate(infos) if i != src and not (
        source.state_generation >= 0 and info.state_generation == source.state_generation
        and info.step == source.step)]
    return None if len(lacking) == len(infos) - 1 else lacking


def shared_commit(infos: Sequence[MemberInfo]) -> bool:
    """Whether every member holds the same commit, so that syncing would move nothing.

    Members that were synced in the same world and stand at the same committed step
    hold identical state: they started that world from one state and took identical
    data-parallel steps. A member with no state, or from another world, needs a sync.
    """
    first = infos[0]
    return first.state_generation >= 0 and all(
        i.state_generation == first.state_generation and i.step == first.step for i in infos)
