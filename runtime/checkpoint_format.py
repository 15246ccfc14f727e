"""The bytes of one checkpoint: host snapshot, data file, manifest, verified read-back.

A checkpoint of one shard at one step is two files:

* ``step-<step>.<token>.data``: every tensor's raw bytes, each at a 64-byte aligned
  offset, followed by the pickled structure of the payload in which each tensor is a
  reference into that table. The random token makes every attempt a new file, so a
  writer never overwrites bytes a committed manifest points at.
* ``step-<step>.manifest.json``: step, epoch, world size, the data file's name, size and
  checksum, the tensor table (``[dtype, shape, offset, nbytes]`` per tensor) and a
  checksum of the manifest itself. It is written last; its presence commits the
  checkpoint.

The structure is pickled with a closed vocabulary (dicts, lists, tuples, sets, str,
bytes, numbers, bool, None, OrderedDict, tensors, dtypes, devices, sizes): saving
anything else fails at once with a message, and loading refuses every other global, so a
checkpoint on a shared volume can never run code in the process that restores it.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import zlib
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy
import torch

from .checkpoint_storage import Bytes, ReadStream, StagedFile

FORMAT_VERSION = 1
"""Bump when a reader of the previous version would misread a new checkpoint."""

ALIGNMENT = 64
"""Tensor offsets in the data file: a multiple of every element size (so a tensor can be
viewed in place) and of a cache line."""
CHUNK_BYTES = 16 << 20
"""Write granularity: large enough for full-speed I/O, small enough to interleave hashing."""
SMALL_PIECE_BYTES = 1 << 20
"""Pieces smaller than this are gathered into writes of at least this size."""

CHECKSUMS = ("crc32", "sha256")
"""Data checksums a checkpoint may use. crc32 is the default: it is the faster of the two
in the benchmark and catches what a checkpoint must survive (torn, truncated or bit-rotted
files); sha256 is there for those who also want a cryptographic digest."""


class CheckpointError(Exception):
    """A checkpoint could not be written or read; the message says where and why."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint's files disagree with its manifest (truncated, altered or missing)."""


class UnsupportedPayload(CheckpointError, TypeError):
    """The payload holds an object a checkpoint does not store."""


@dataclass(frozen=True)
class CheckpointMeta:
    """What a checkpoint says about itself, besides its payload; stored in the manifest.

    ``epoch`` is the caller's to define (the State records its data epoch);
    ``world_size`` is the number of members that trained up to ``step``; ``extra``
    holds JSON values to read back without loading the payload (e.g. the LR rule).
    """

    step: int
    epoch: int = 0
    world_size: int = 1
    extra: Mapping[str, Any] = field(default_factory=dict)


class _Digest(Protocol):
    def update(self, data: Bytes, /) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32:
    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Bytes, /) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def new_digest(algorithm: str) -> _Digest:
    """A running checksum by name (one of :data:`CHECKSUMS`)."""
    if algorithm == "crc32":
        return _Crc32()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checksum {algorithm!r}; use one of {', '.join(CHECKSUMS)}")


# --- snapshot -------------------------------------------------------------------------

_PLAIN_TYPES: tuple[type, ...] = (OrderedDict, complex, range, slice)
"""Types pickled by reduction whose reconstruction the loader allows (see _SafeUnpickler)."""

_SAFE_GLOBALS = {
    ("collections", "OrderedDict"),
    ("builtins", "complex"),
    ("builtins", "range"),
    ("builtins", "slice"),
}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes sit in the data file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpoint(f"unknown tensor dtype {name!r}")
    return dtype


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
            return ("dtype", _dtype_name(obj))
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
        if isinstance(obj, _PLAIN_TYPES) or any(obj is t for t in _PLAIN_TYPES):
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


# --- manifest -------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """The commit record of one checkpoint (see the module docstring)."""

    meta: CheckpointMeta
    shard: str
    data_file: str
    data_size: int
    checksum: str
    tensors: tuple[TensorEntry, ...]
    objects_offset: int
    objects_length: int
    created: float
    writer: Mapping[str, Any]

    def to_json(self) -> bytes:
        """The manifest as JSON, with a checksum over its own canonical form."""
        doc: dict[str, Any] = {
            "formatVersion": FORMAT_VERSION,
            "shard": self.shard,
            "step": self.meta.step,
            "epoch": self.meta.epoch,
            "worldSize": self.meta.world_size,
            "extra": dict(self.meta.extra),
            "created": self.created,
            "writer": dict(self.writer),
            "data": {"file": self.data_file, "size": self.data_size, "checksum": self.checksum},
            "objects": {"offset": self.objects_offset, "length": self.objects_length},
            "tensors": [
                [_dtype_name(t.dtype), list(t.shape), t.offset, t.nbytes] for t in self.tensors
            ],
        }
        doc["manifestChecksum"] = _manifest_digest(doc)
        # Indented for people, but one line per tensor so that a large model's table
        # stays a table.
        tensors = doc.pop("tensors")
        head = json.dumps(doc, indent=1).removesuffix("\n}")
        rows = ",\n  ".join(json.dumps(row, separators=(",", ":")) for row in tensors)
        table = f"[\n  {rows}\n ]" if tensors else "[]"
        return f'{head},\n "tensors": {table}\n}}\n'.encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Manifest:
        """Parse and check a manifest; raises :class:`CorruptCheckpoint` with the reason."""
        try:
            doc = json.loads(raw)
            claimed = doc.pop("manifestChecksum")
        except (ValueError, KeyError, AttributeError, TypeError) as exc:
            raise CorruptCheckpoint(f"manifest is not a checkpoint manifest: {exc!r}") from exc
        if claimed != _manifest_digest(doc):
            raise CorruptCheckpoint("manifest checksum does not match its content")
        version = doc.get("formatVersion")
        if version != FORMAT_VERSION:
            raise CorruptCheckpoint(
                f"manifest has format version {version!r}; this runtime reads version"
                f" {FORMAT_VERSION} (was it written by a different ringwright release?)"
            )
        try:
            manifest = cls._from_doc(doc)
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpoint(f"manifest misses or mistypes a field: {exc!r}") from exc
        manifest._check_layout()
        return manifest

    @classmethod
    def _from_doc(cls, doc: dict[str, Any]) -> Manifest:
        tensors = tuple(
            TensorEntry(_dtype_from_name(str(d)), tuple(int(n) for n in s), int(o), int(b))
            for d, s, o, b in doc["tensors"]
        )
        meta = CheckpointMeta(
            step=int(doc["step"]),
            epoch=int(doc["epoch"]),
            world_size=int(doc["worldSize"]),
            extra=dict(doc["extra"]),
        )
        return cls(
            meta=meta,
            shard=str(doc["shard"]),
            data_file=str(doc["data"]["file"]),
            data_size=int(doc["data"]["size"]),
            checksum=str(doc["data"]["checksum"]),
            tensors=tensors,
            objects_offset=int(doc["objects"]["offset"]),
            objects_length=int(doc["objects"]["length"]),
            created=float(doc["created"]),
            writer=dict(doc["writer"]),
        )

    def _check_layout(self) -> None:
        # Checked before a byte of the data file is read, so that a bad table can never
        # make the reader allocate more memory than the file holds.
        position = 0
        for entry in self.tensors:
            expected = entry.dtype.itemsize
            for dim in entry.shape:
                expected *= dim
            negative = any(dim < 0 for dim in entry.shape)
            if negative or entry.offset < position or entry.nbytes != expected:
                raise CorruptCheckpoint(f"tensor table entry {entry} is inconsistent")
            position = entry.offset + entry.nbytes
        if self.objects_offset < position or (
            self.objects_offset + self.objects_length != self.data_size
        ):
            raise CorruptCheckpoint("tensor table and object section do not tile the data file")
        if self.checksum.partition(":")[0] not in CHECKSUMS:
            raise CorruptCheckpoint(f"unknown data checksum {self.checksum!r}")


def _manifest_digest(doc: Mapping[str, Any]) -> str:
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(canonical).hexdigest()


# --- read-back ------------------------------------------------------------------------


class _SafeUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, tensors: list[torch.Tensor]) -> None:
        super().__init__(io.BytesIO(data))
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        kind, value = pid
        if kind == "tensor":
            return self._tensors[value]
        if kind == "dtype":
            return _dtype_from_name(value)
        if kind == "device":
            return torch.device(value)
        if kind == "size":
            return torch.Size(value)
        raise CorruptCheckpoint(f"unknown reference {kind!r} in checkpoint structure")

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        raise CorruptCheckpoint(
            f"checkpoint structure refers to {module}.{name}, which checkpoints never hold;"
            " refusing to load it"
        )


def _read_into(stream: ReadStream, target: memoryview) -> None:
    filled = 0
    while filled < len(target):
        got = stream.readinto(target[filled:])
        if not got:
            raise CorruptCheckpoint("data file ends before the manifest says it does")
        filled += got


def _update_all(digest: _Digest, pieces: list[memoryview]) -> None:
    for piece in pieces:
        digest.update(piece)


def read_payload(stream: ReadStream, manifest: Manifest) -> dict[str, Any]:
    """Read a data file into new CPU tensors, verifying it against ``manifest``.

    The checksum is computed over the bytes as they land in the tensors, so the file is
    read once; a mismatch raises :class:`CorruptCheckpoint` and nothing is returned.
    """
    algorithm, _, expected = manifest.checksum.partition(":")
    digest = new_digest(algorithm)
    tensors: list[torch.Tensor] = []
    position = 0
    # Checksumming runs beside the reads (both release the GIL), a batch behind them; a
    # single worker keeps the batches in file order, and batching keeps the hand-over
    # cost of thousands of small tensors low.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-verify") as hasher:
        batch: list[memoryview] = []
        batch_bytes = 0

        def hash_batch() -> None:
            nonlocal batch_bytes
            hasher.submit(_update_all, digest, batch.copy())
            batch.clear()
            batch_bytes = 0

        def read_hashed(target: memoryview) -> None:
            nonlocal batch_bytes
            for start in range(0, len(target), CHUNK_BYTES):
                chunk = target[start : start + CHUNK_BYTES]
                _read_into(stream, chunk)
                batch.append(chunk)
                batch_bytes += len(chunk)
                if batch_bytes >= SMALL_PIECE_BYTES:
                    hash_batch()

        for entry in manifest.tensors:
            if entry.offset > position:
                read_hashed(memoryview(bytearray(entry.offset - position)))
            tensor = torch.empty(entry.shape, dtype=entry.dtype)
            if entry.nbytes:
                read_hashed(tensor.reshape(-1).view(torch.uint8).numpy().data)
            tensors.append(tensor)
            position = entry.offset + entry.nbytes
        rest = memoryview(bytearray(manifest.data_size - position))
        read_hashed(rest)
        hash_batch()
    if digest.hexdigest() != expected:
        raise CorruptCheckpoint(
            f"data checksum {algorithm}:{digest.hexdigest()} does not match the manifest's"
            f" {manifest.checksum}"
        )
    structure = bytes(rest[manifest.objects_offset - position :])
    try:
        payload = _SafeUnpickler(structure, tensors).load()
    except CorruptCheckpoint:
        raise
    except Exception as exc:
        # The checksum matched, so this is a writer bug or a foreign file, not bit rot.
        raise CorruptCheckpoint(f"checkpoint structure does not load: {exc!r}") from exc
    if not isinstance(payload, dict):
        raise CorruptCheckpoint(f"checkpoint payload is a {type(payload).__name__}, not a dict")
    return payload
