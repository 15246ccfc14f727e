"""Bucketed gradient all-reduce that overlaps with ``backward()``.

Parameters are grouped into buckets of about ``bucket_bytes`` in reverse order of
registration (backward produces the last layers' gradients first). A hook on every
parameter fires once its gradient is accumulated; when all of a bucket's gradients
are in, the bucket is copied into its flat buffer and handed to one communication
thread, which all-reduces the buckets in launch order while backward goes on. At
:meth:`GradientBuckets.finish` the buckets still open (parameters that got no
gradient on this rank) are sent with zeros, everything is waited for, and every
``.grad`` becomes a view into its reduced buffer: one copy in, none back.

A parameter that got no gradient on *any* rank keeps ``grad=None``, so the optimizer
skips it as it would without distribution: every bucket carries one flag per
parameter (1 where this rank had a gradient), summed with the gradients.

Optional compression sends each bucket as bf16 or fp16 and keeps what rounding lost
in a per-bucket residual that is added back before the next step's rounding (error
feedback), so the error does not accumulate over steps.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

import torch

DEFAULT_BUCKET_BYTES = 25 * 2**20


class Compression(StrEnum):
    """Wire format of the gradient buckets."""

    NONE = "none"
    BF16 = "bf16"
    FP16 = "fp16"


WIRE_DTYPES = {Compression.BF16: torch.bfloat16, Compression.FP16: torch.float16}


@dataclass(frozen=True)
class BucketSettings:
    """How gradients are bucketed and sent."""

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Close a bucket once its gradients reach this many bytes."""
    compression: Compression = Compression.NONE
    """Send floating-point buckets as bf16/fp16 with error feedback; off by default."""


class FlatReducer(Protocol):
    """What the buckets need from the collective backend of the current world."""

    def allreduce_(self, flat: torch.Tensor, name: str) -> None:
        """Sum ``flat`` over the world in place."""
        ...


def plan_buckets(params: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``params`` per bucket: reverse order, one dtype and device per bucket,
    a bucket closed once it holds ``bucket_bytes`` (a larger parameter gets its own)."""
    buckets: list[list[int]] = []
    open_: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    for i in reversed(range(len(params))):
        p = params[i]
        key = (p.dtype, p.device)
        members, size = open_.get(key, ([], 0))
        members.append(i)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            buckets.append(members)
            open_.pop(key, None)
        else:
            open_[key] = (members, size)
    buckets.extend(members for members, _ in open_.values())
    return buckets


@dataclass
class _Bucket:
    index: int
    params: list[torch.Tensor]
    bounds: list[tuple[int, int]]
    buffer: torch.Tensor
    """Gradients, then one presence flag per parameter."""
    residual: torch.Tensor | None = None
    ready: set[int] = field(default_factory=set)
    future: concurrent.futures.Future[None] | None = None

    @property
    def numel(self) -> int:
        return self.bounds[-1][1]


class GradientBuckets:
    """Hooks on a model's parameters that all-reduce their gradients in buckets.

    ``reducer()`` is asked at every launch for the backend of the current world.
    Expects one ``backward()`` per :meth:`finish`.
    """

    def __init__(self, params: Iterable[torch.Tensor], reducer: Callable[[], FlatReducer],
                 settings: BucketSettings = BucketSettings()) -> None:
        trainable = [p for p in params if p.requires_grad]
        self._reducer = reducer
        self._settings = settings
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="ringwright-buckets")
        self._buckets: list[_Bucket] = []
        for number, members in enumerate(plan_buckets(trainable, settings.bucket_bytes)):
            ps = [trainable[i] for i in members]
            bounds, start = [], 0
            for p in ps:
                bounds.append((start, start + p.numel()))
                start += p.numel()
            buffer = torch.zeros(start + len(ps), dtype=ps[0].dtype, device=ps[0].device)
            bucket = _Bucket(number, ps, bounds, buffer)
            self._buckets.append(bucket)
            for slot, p in enumerate(ps):
                # torch leaves this method unannotated.
                p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                    self._hook(bucket, slot))

    def _hook(self, bucket: _Bucket, slot: int) -> Callable[[torch.Tensor], None]:
        def ready(_: torch.Tensor) -> None:
            bucket.ready.add(slot)
            if len(bucket.ready) == len(bucket.params) and bucket.future is None:
                self._launch(bucket)

        return ready

    def _launch(self, bucket: _Bucket) -> None:
        """Copy the gradients in (zeros where there is none) and queue the all-reduce."""
        flags = bucket.buffer[bucket.numel:]
        with torch.no_grad():
            for slot, (p, (a, b)) in enumerate(zip(bucket.params, bucket.bounds, strict=True)):
                region = bucket.buffer[a:b]
                if p.grad is None:
                    region.zero_()
                    flags[slot] = 0
                    continue
                # A gradient left in place (zero_grad(set_to_none=False)) is already there.
                if p.grad.data_ptr() != region.data_ptr():
                    region.copy_(p.grad.reshape(-1))
                flags[slot] = 1
        if bucket.buffer.is_cuda:
            # The communication thread runs on its own stream: the copies must be done.
            torch.cuda.current_stream(bucket.buffer.device).synchronize()
        reducer = self._reducer()
        bucket.future = self._pool.submit(self._reduce, reducer, bucket)

    def _reduce(self, reducer: FlatReducer, bucket: _Bucket) -> None:
        name = f"bucket.{bucket.index}"
        wire = WIRE_DTYPES.get(self._settings.compression)
        if wire is None or not bucket.buffer.is_floating_point():
            reducer.allreduce_(bucket.buffer, name)
            return
        with torch.no_grad():
            exact = bucket.buffer
            if bucket.residual is not None:
                exact = exact + bucket.residual
            sent = exact.to(wire)
            bucket.residual = exact - sent.to(exact.dtype)
            reducer.allreduce_(sent, name)
            bucket.buffer.copy_(sent)

    def finish(self, *, average_over: int | None) -> None:
        """Launch what is still open, wait for every bucket, and install the results.

        ``average_over``: divide by this world size; None leaves the sum. Raises the
        first failure of any bucket (after all of them are settled).
        """
        for bucket in self._buckets:
            if bucket.future is None:
                self._launch(bucket)
        error = self._settle()
        if error is not None:
            raise error
        with torch.no_grad():
            for bucket in self._buckets:
                flags = bucket.buffer[bucket.numel:]
                if average_over is not None:
                    bucket.buffer[:bucket.numel] /= average_over
                for slot, (p, (a, b)) in enumerate(zip(bucket.params, bucket.bounds,
                                                       strict=True)):
                    p.grad = bucket.buffer[a:b].view_as(p) if flags[slot] > 0 else None

    def discard(self) -> None:
        """Forget a step that did not finish (after a failure): wait out its buckets."""
        self._settle()

    def close(self) -> None:
        """Stop the communication thread."""
        self._settle()
        self._pool.shutdown(wait=True)

    def _settle(self) -> BaseException | None:
        error: BaseException | None = None
        for bucket in self._buckets:
            if bucket.future is not None:
                failure = bucket.future.exception()
                error = error or failure
            bucket.future = None
            bucket.ready.clear()
        return error
