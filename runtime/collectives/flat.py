"""Flattening tensors into one buffer per dtype, so a collective runs once per dtype."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def by_dtype(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by dtype, in first-seen order (the same on every rank)."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


def flatten(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One contiguous copy of ``tensors`` (all of one dtype) on ``device``.

    The tensors may sit on different devices: a GPU state holds CPU tensors too
    (Adam's ``step`` counts stay on the CPU), each is moved before they are joined.
    """
    return torch.cat([t.detach().reshape(-1).to(device) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors``, on their own devices."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n


def gradients(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The ``.grad`` of every trainable parameter, zero-filled where there is none yet.

    A rank whose batch was empty still takes part in the allreduce with zeros.
    """
    grads: list[torch.Tensor] = []
    for p in params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    return grads
