"""Messages between workers and parameter servers: a JSON header plus raw tensor bytes.

Two layouts. One buffer (:func:`encode`, the control plane's gRPC calls): 8 bytes
little-endian header length, the UTF-8 JSON header, then each tensor's bytes back to
back. Frames (:func:`to_frames`, the data plane): the JSON header, then one frame per
tensor that is the tensor's own memory, so sending copies nothing. No pickling and no
per-element encoding: tensors travel as their memory, and a decoded tensor is a view
of the received buffer (callers copy before writing in place).
"""

from __future__ import annotations

import json
import struct
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

_DTYPES = {str(d).removeprefix("torch."): d for d in
           (torch.float32, torch.float64, torch.float16, torch.bfloat16,
            torch.int64, torch.int32, torch.uint8, torch.bool)}
_LEN = struct.Struct("<Q")

Header = dict[str, Any]
Tensors = dict[str, torch.Tensor]


class CodecError(ValueError):
    """A message this side cannot decode."""


def _raw(name: str, tensor: torch.Tensor) -> tuple[list[Any], memoryview]:
    """The index entry (name, dtype, shape) and the bytes of one tensor: a view of its
    memory when it is a contiguous CPU tensor, else of a contiguous copy."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous()
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise CodecError(f"tensor {name}: dtype {tensor.dtype} is not supported")
    raw = memoryview(flat.view(torch.uint8).numpy().data) if flat.numel() else memoryview(b"")
    return [name, dtype, list(tensor.shape)], raw


def to_frames(doc: Mapping[str, Any], tensors: Mapping[str, torch.Tensor] | None = None
              ) -> list[memoryview | bytes]:
    """One data-plane message: ``doc`` (JSON values; the tensors' index is added as
    ``t``) as the first frame, then each tensor's memory as a frame of its own. The
    tensors must not change until the message is sent."""
    index, frames = [], []
    for name, tensor in (tensors or {}).items():
        entry, raw = _raw(name, tensor)
        index.append(entry)
        frames.append(raw)
    head = json.dumps({**doc, "t": index}, separators=(",", ":")).encode()
    return [head, *frames]


def from_frames(frames: Sequence[Any]) -> tuple[Header, Tensors]:
    """The document and the tensors of a message made by :func:`to_frames`; each
    tensor is a view of its frame (no copy)."""
    if not frames:
        raise CodecError("empty message")
    try:
        doc = json.loads(bytes(frames[0]))
    except ValueError as exc:
        raise CodecError(f"message header is not JSON: {exc}") from exc
    index = doc.pop("t", [])
    if len(index) != len(frames) - 1:
        raise CodecError(f"message names {len(index)} tensors but carries {len(frames) - 1}")
    tensors: Tensors = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only frames: never written
        for (name, dtype, shape), frame in zip(index, frames[1:], strict=True):
            kind = _DTYPES.get(dtype)
            if kind is None:
                raise CodecError(f"tensor {name}: unknown dtype {dtype}")
            view = memoryview(frame)
            if view.nbytes == 0:
                tensors[name] = torch.empty(shape, dtype=kind)
                continue
            raw = torch.frombuffer(view, dtype=torch.uint8)
            try:
                tensors[name] = raw.view(kind).reshape(shape)
            except RuntimeError as exc:
                raise CodecError(f"tensor {name}: {view.nbytes} bytes do not make a "
                                 f"{dtype} tensor of shape {shape}") from exc
    return doc, tensors


def encode(header: Mapping[str, Any], tensors: Mapping[str, torch.Tensor] | None = None) -> bytes:
    """One message: ``header`` (JSON values) and ``tensors`` (CPU, any layout)."""
    index = []
    chunks: list[memoryview] = []
    offset = 0
    for name, tensor in (tensors or {}).items():
        entry, raw = _raw(name, tensor)
        index.append([*entry, offset, raw.nbytes])
        chunks.append(raw)
        offset += raw.nbytes
    head = json.dumps({"h": dict(header), "t": index}, separators=(",", ":")).encode()
    return b"".join([_LEN.pack(len(head)), head, *chunks])


def decode(data: bytes) -> tuple[Header, Tensors]:
    """The header and the tensors of a message made by :func:`encode`."""
    if len(data) < _LEN.size:
        raise CodecError("message shorter than its length prefix")
    (length,) = _LEN.unpack_from(data)
    start = _LEN.size + length
    try:
        doc = json.loads(data[_LEN.size:start])
    except ValueError as exc:
        raise CodecError(f"message header is not JSON: {exc}") from exc
    tensors: Tensors = {}
    with warnings.catch_warnings():
        # The buffer is immutable bytes; tensors are views that callers never write.
        warnings.simplefilter("ignore", UserWarning)
        for name, dtype, shape, offset, nbytes in doc["t"]:
            kind = _DTYPES.get(dtype)
            if kind is None:
                raise CodecError(f"tensor {name}: unknown dtype {dtype}")
            if start + offset + nbytes > len(data):
                raise CodecError(f"tensor {name} runs past the end of the message")
            if nbytes == 0:
                tensors[name] = torch.empty(shape, dtype=kind)
                continue
            raw = torch.frombuffer(data, dtype=torch.uint8, count=nbytes,
                                   offset=start + offset)
            tensors[name] = raw.view(kind).reshape(shape)
    return doc["h"], tensors
