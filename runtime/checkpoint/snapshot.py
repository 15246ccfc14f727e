"""Taking a checkpoint: copy the payload into host memory, then stream it to storage.

:func:`take_snapshot` runs on the training thread and is all the stall a checkpoint
causes; :func:`write_data` runs on the writer thread and produces the data file that
:mod:`ringwright.runtime.checkpoint.format` describes and reads back.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy
import torch

from .format import (
    ALIGNMENT,
    PLAIN_TYPES,
    TensorEntry,
    UnsupportedPayload,
    dtype_name,
    new_digest,
)
from .storage import Bytes, StagedFile

CHUNK_BYTES = 16 << 20
"""Largest single write: big enough for full-speed I/O; large tensors go out in pieces."""
SMALL_PIECE_BYTES = 1 << 20
"""Pieces smaller than this are gathered into writes of at least this size."""


class _SnapshotPickler(pickle.Pickler):
    """Pickles the payload's structure; tensors and torch values become references."""

    def __init__(self, out: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(out, protocol=5)
        self._tensors = tensors
        # The same tensor object twice (e.g. tied weights) is stored once and restored
        # as one object, as torch.save does.
        self._index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return ("tensor", self._tensor_index(obj))
        if isinstance(obj, torch.dtype):
            return ("dtype", dtype_name(obj))
        if isinstance(obj, torch.device):
            return ("device", str(obj))
        if isinstance(obj, torch.Size):
            return ("size", tuple(obj))
        return None

    def _tensor_index(self, tensor: torch.Tensor) -> int:
        known = self._index.get(id(tensor))
        if known is not None:
            return known
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_meta:
            raise UnsupportedPayload(
                f"cannot checkpoint a {tensor.layout} tensor{' (quantized)' * tensor.is_quantized}"
                f" on {tensor.device} of shape {tuple(tensor.shape)}; store a dense tensor"
                " with real data instead (e.g. .to_dense() or .dequantize())"
            )
        self._index[id(tensor)] = len(self._tensors)
        self._tensors.append(tensor)
        return len(self._tensors) - 1

    def reducer_override(self, obj: Any) -> Any:
        # Called for every object outside pickle's fast paths: exactly the ones that
        # would otherwise be saved as "call this global", which the loader refuses.
        if isinstance(obj, PLAIN_TYPES) or any(obj is t for t in PLAIN_TYPES):
            return NotImplemented
        kind = type(obj)
        raise UnsupportedPayload(
            f"checkpoint payload holds a {kind.__module__}.{kind.__qualname__} ({obj!r:.80});"
            " a checkpoint stores tensors, dicts, lists, tuples, sets, str, bytes, int, float,"
            " bool and None: convert it first (e.g. int(x), x.tolist(), or a state_dict())"
        )


class HostBuffer:
    """Host memory reused from one snapshot to the next.

    Fresh host memory costs page faults on first touch (several times the copy itself,
    see the benchmark) and pinned memory costs a slow registration, so the buffer is
    kept and grown only when the state grows: one copy of the state, held between
    checkpoints. Its owner must not take a snapshot while the previous one is still
    being written (the Checkpointer waits for that write first).
    """

    def __init__(self) -> None:
        self._arena: torch.Tensor | None = None
        self._pinned = False
        self._pinning_failed = False

    def get(self, nbytes: int, *, pinned: bool) -> torch.Tensor:
        """A uint8 tensor of at least ``nbytes``, page-locked when ``pinned`` is asked."""
        pinned = pinned and not self._pinning_failed
        arena = self._arena
        if arena is not None and arena.numel() >= nbytes and (self._pinned or not pinned):
            return arena
        self._arena = None  # free the old buffer before allocating its replacement
        try:
            arena = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        except RuntimeError:
            # Page-locked memory is limited (memlock, driver); pageable still works, with
            # a synchronous and slower device-to-host copy. Not retried: each attempt
            # would cost a failed registration on every checkpoint.
            self._pinning_failed = True
            pinned = False
            arena = torch.empty(nbytes, dtype=torch.uint8)
        self._arena, self._pinned = arena, pinned
        return arena

    def release(self) -> None:
        """Drop the buffer; a write still using it keeps it alive until it finishes."""
        self._arena = None


@dataclass(frozen=True)
class Snapshot:
    """A payload ready to write: the structure, and the bytes of each tensor.

    ``sources[i]`` is a flat uint8 CPU tensor with the bytes of ``entries[i]``: a view
    into the host buffer, or the caller's own tensor when it was handed over uncopied.
    """

    entries: tuple[TensorEntry, ...]
    sources: tuple[torch.Tensor, ...]
    objects: bytes

    @property
    def tensors_end(self) -> int:
        """Where the object section starts in the data file."""
        return self.entries[-1].offset + self.entries[-1].nbytes if self.entries else 0

    @property
    def nbytes(self) -> int:
        """Size of the data file this snapshot becomes."""
        return self.tensors_end + len(self.objects)


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def _writable_as_is(tensor: torch.Tensor) -> bool:
    # Bytes in memory equal the values only without lazy conjugate/negative bits.
    return (
        tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def take_snapshot(
    payload: Mapping[str, Any], buffer: HostBuffer, *, copy: bool = True
) -> Snapshot:
    """Copy ``payload`` into host memory, so that training may change it right after.

    CUDA tensors are copied into page-locked memory asynchronously and waited for once
    at the end. CPU tensors are copied too, unless ``copy`` is False: then contiguous
    CPU tensors are written from where they are, and must not change until the write
    is done. Raises :class:`UnsupportedPayload` for objects a checkpoint does not store.
    """
    tensors: list[torch.Tensor] = []
    structure = io.BytesIO()
    _SnapshotPickler(structure, tensors).dump(
        payload if isinstance(payload, dict) else dict(payload)
    )

    entries: list[TensorEntry] = []
    offset = 0
    for tensor in tensors:
        offset = _aligned(offset)
        nbytes = tensor.numel() * tensor.element_size()
        entries.append(TensorEntry(tensor.dtype, tuple(tensor.shape), offset, nbytes))
        offset += nbytes
    copied = [copy or not _writable_as_is(t) for t in tensors]
    slots: list[int] = []  # each copied tensor's offset in the host buffer
    arena_size = 0
    for entry, needed in zip(entries, copied, strict=True):
        if needed:
            slots.append(arena_size)
            arena_size = _aligned(arena_size + entry.nbytes)
    pinned = torch.cuda.is_available() and any(t.is_cuda for t in tensors)
    arena = buffer.get(arena_size, pinned=pinned)

    sources: list[torch.Tensor] = []
    streams: set[torch.cuda.Stream] = set()
    slot = iter(slots)
    with torch.no_grad():
        for tensor, entry, needed in zip(tensors, entries, copied, strict=True):
            if not needed:
                sources.append(tensor.detach().reshape(-1).view(torch.uint8))
                continue
            start = next(slot)
            target = arena[start : start + entry.nbytes]
            sources.append(target)
            if _writable_as_is(tensor):
                # A plain memcpy (without the GIL): on host memory it beats torch's
                # threaded copy, whose thread pool stalls when cores are oversubscribed.
                flat = tensor.detach().reshape(-1).view(torch.uint8)
                numpy.copyto(target.numpy(), flat.numpy())
                continue
            typed = target.view(tensor.dtype).view(tensor.shape)
            if tensor.is_cuda and pinned:
                typed.copy_(tensor, non_blocking=True)
                streams.add(torch.cuda.current_stream(tensor.device))
            else:
                typed.copy_(tensor)
        for stream in streams:
            stream.synchronize()
    return Snapshot(tuple(entries), tuple(sources), structure.getvalue())


def write_data(snapshot: Snapshot, out: StagedFile, algorithm: str) -> str:
    """Stream ``snapshot`` into ``out`` and return the data checksum as ``algo:hex``."""
    digest = new_digest(algorithm)
    # Small pieces (biases, norms, padding) are gathered into one write: a model has
    # thousands of them, and a system call each would cost more than their bytes.
    gathered = bytearray()

    def put(data: Bytes) -> None:
        digest.update(data)
        if len(data) < SMALL_PIECE_BYTES:
            gathered.extend(data)
            if len(gathered) < SMALL_PIECE_BYTES:
                return
            data = gathered
        elif gathered:
            out.write(gathered)
        out.write(data)
        gathered.clear()

    position = 0
    for entry, source in zip(snapshot.entries, snapshot.sources, strict=True):
        if entry.offset > position:
            put(bytes(entry.offset - position))
        view = source.numpy().data
        for start in range(0, entry.nbytes, CHUNK_BYTES):
            put(view[start : start + CHUNK_BYTES])
        position = entry.offset + entry.nbytes
    put(snapshot.objects)
    out.write(gathered)
    return f"{algorithm}:{digest.hexdigest()}"
