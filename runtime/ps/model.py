"""Binds a torch model to the parameter servers on a worker.

Dense parameters stay in the model and are overwritten by each pull. Every
``nn.Embedding`` / ``nn.EmbeddingBag`` keeps only the rows the current batch touches:
its weight becomes a small parameter of those rows, and a forward pre-hook maps the
batch's global ids onto positions in it. After ``backward()`` that weight's gradient is
exactly the sparse gradient to push.

A table on the meta device (``nn.Embedding(n, d, device="meta")``) is never held whole
by anyone: the servers create each of its rows on first use, drawn from N(0, std²) by the
row's id (std 1.0 unless given: torch's own initialisation of embeddings), so a table of
tens of millions of rows costs memory only for the rows training touches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .partition import Kind, TensorSpec


class PSModel:
    """A model whose parameters live on parameter servers (see the module doc)."""

    def __init__(self, model: nn.Module, init_std: Mapping[str, float] | None = None) -> None:
        """``init_std``: by table name (``module.weight``), the spread of the rows the
        servers create for a table on the meta device."""
        self.model = model
        self.tables: dict[str, nn.Embedding | nn.EmbeddingBag] = {}
        for name, module in model.named_modules():
            if isinstance(module, nn.Embedding | nn.EmbeddingBag):
                if module.max_norm is not None:
                    raise ValueError(f"{name}: max_norm renormalises rows in place; "
                                     "not supported for server-held tables")
                if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                    raise ValueError(f"{name}: padding_idx is not supported for "
                                     "server-held tables")
                self.tables[f"{name}.weight"] = module
        table_params = {id(m.weight) for m in self.tables.values()}
        self.dense = {n: p for n, p in model.named_parameters() if id(p) not in table_params}
        self.shapes = {n: (m.num_embeddings, m.embedding_dim) for n, m in self.tables.items()}
        given = dict(init_std or {})
        unknown = sorted(set(given) - {n for n, m in self.tables.items() if m.weight.is_meta})
        if unknown:
            raise ValueError(f"init_std names {unknown}, which are not embedding tables on "
                             "the meta device; only those are created by the servers")
        self.init_std = {n: given.get(n, 1.0) for n, m in self.tables.items()
                         if m.weight.is_meta}
        """Tables the servers create row by row, with the spread of their rows."""
        self._ids: dict[str, torch.Tensor] = {}
        for name, module in self.tables.items():
            module.register_forward_pre_hook(self._remap(name))

    def specs(self) -> list[TensorSpec]:
        """What the partitioner places: dense parameters and the tables."""
        out = [TensorSpec(n, tuple(p.shape), p.element_size()) for n, p in self.dense.items()]
        out += [TensorSpec(n, shape, 4, Kind.EMBEDDING, self.init_std.get(n))
                for n, shape in self.shapes.items()]
        return out

    def dense_targets(self) -> dict[str, torch.Tensor]:
        """The dense parameters a pull can write into in place (float32, contiguous:
        what the servers hold); the others are copied in by :meth:`load`."""
        return {n: p.detach() for n, p in self.dense.items()
                if p.dtype == torch.float32 and p.is_contiguous()}

    def initial(self) -> dict[str, torch.Tensor]:
        """The model's current values, for the servers' first initialisation (tables the
        servers create have none)."""
        out = {n: p.detach() for n, p in self.dense.items()}
        out.update({n: m.weight.detach() for n, m in self.tables.items()
                    if n not in self.init_std})
        return out

    def release_tables(self) -> None:
        """Drop the full tables from this worker: the servers hold them now."""
        for name, module in self.tables.items():
            module.weight = nn.Parameter(torch.empty(0, self.shapes[name][1]))

    def load(self, dense: Mapping[str, torch.Tensor],
             rows: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Take pulled values: dense in place, each table's touched rows as its weight."""
        with torch.no_grad():
            for name, value in dense.items():
                target = self.dense[name]
                if value.data_ptr() != target.data_ptr():  # else pulled into it in place
                    target.copy_(value)
        for name, (ids, values) in rows.items():
            self._ids[name] = ids
            self.tables[name].weight = nn.Parameter(values.clone())
        self.model.zero_grad(set_to_none=True)

    def gradients(self) -> tuple[dict[str, torch.Tensor],
                                 dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Dense gradients and, per table, (ids, gradient rows) after ``backward()``."""
        dense = {n: p.grad if p.grad is not None else torch.zeros_like(p)
                 for n, p in self.dense.items()}
        sparse = {}
        for name, module in self.tables.items():
            ids = self._ids.get(name)
            if ids is None:
                continue
            grad = module.weight.grad
            sparse[name] = (ids, grad if grad is not None else torch.zeros_like(module.weight))
        return dense, sparse

    def _remap(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            ids = self._ids.get(name)
            if ids is None:
                raise RuntimeError(f"{name}: no rows pulled for this batch")
            raw = args[0]
            pos = torch.searchsorted(ids, raw)
            found = pos.clamp(max=max(len(ids) - 1, 0))
            if raw.numel() and (len(ids) == 0 or not bool((ids[found] == raw).all())):
                raise KeyError(f"{name}: the batch uses ids that were not pulled; "
                               "the ids function must list every id the forward uses")
            return (pos, *args[1:])

        return hook
