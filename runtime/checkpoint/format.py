"""The bytes of one checkpoint on disk: data file, manifest, and verified read-back.

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
:mod:`ringwright.runtime.checkpoint.snapshot` produces the data file.
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

import torch

from .storage import Bytes, ReadStream

FORMAT_VERSION = 1
"""Bump when a reader of the previous version would misread a new checkpoint."""

ALIGNMENT = 64
"""Tensor offsets in the data file: a multiple of every element size (so a tensor can be
viewed in place) and of a cache line."""
# Restore reads a tensor in pieces of up to _READ_CHUNK_BYTES and hands them to the
# verifying thread in batches of at least _VERIFY_BATCH_BYTES.
_READ_CHUNK_BYTES = 16 << 20
_VERIFY_BATCH_BYTES = 1 << 20

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


class Digest(Protocol):
    """A running checksum (the subset of hashlib's interface the format uses)."""

    def update(self, data: Bytes, /) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32:
    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Bytes, /) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def new_digest(algorithm: str) -> Digest:
    """A running checksum by name (one of :data:`CHECKSUMS`)."""
    if algorithm == "crc32":
        return _Crc32()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checksum {algorithm!r}; use one of {', '.join(CHECKSUMS)}")


# --- the vocabulary of the pickled structure --------------------------------------------

PLAIN_TYPES: tuple[type, ...] = (OrderedDict, complex, range, slice)
"""Types pickled by reduction whose reconstruction the loader allows (_SAFE_GLOBALS)."""

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


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for torch.float32: how dtypes are named in manifests and structures."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype :func:`dtype_name` named; raises :class:`CorruptCheckpoint` otherwise."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpoint(f"unknown tensor dtype {name!r}")
    return dtype


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
                [dtype_name(t.dtype), list(t.shape), t.offset, t.nbytes] for t in self.tensors
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
            TensorEntry(dtype_from_name(str(d)), tuple(int(n) for n in s), int(o), int(b))
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
            return dtype_from_name(value)
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


def _update_all(digest: Digest, pieces: list[memoryview]) -> None:
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
            for start in range(0, len(target), _READ_CHUNK_BYTES):
                chunk = target[start : start + _READ_CHUNK_BYTES]
                _read_into(stream, chunk)
                batch.append(chunk)
                batch_bytes += len(chunk)
                if batch_bytes >= _VERIFY_BATCH_BYTES:
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
