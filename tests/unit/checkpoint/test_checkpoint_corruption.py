"""A newest checkpoint that fails verification falls back to the previous one, loudly."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import pickle
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ringwright.runtime.checkpoint.checkpointer import Checkpointer, CorruptCheckpoint, LocalStorage
from ringwright.runtime.checkpoint.format import Manifest
from ringwright.runtime.checkpoint.storage import ReadStream

_SIZE = 4096


def _write_three(root: Path) -> Path:
    """Steps 1..3, each a tensor filled with its step; returns the shard folder."""
    with Checkpointer(LocalStorage(root), keep=5) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((_SIZE,), float(step)), "step": step})
            ckpt.flush()
    return root / "model"


def _data_file(shard: Path, step: int) -> Path:
    (found,) = shard.glob(f"step-{step:012d}.*.data")
    return found


def _manifest(shard: Path, step: int) -> Path:
    return shard / f"step-{step:012d}.manifest.json"


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset % len(raw)] ^= 0x40
    path.write_bytes(bytes(raw))


def _flip_tensor_byte(shard: Path) -> None:
    _flip(_data_file(shard, 3), 1000)


def _flip_structure_byte(shard: Path) -> None:
    _flip(_data_file(shard, 3), -3)


def _truncate_data(shard: Path) -> None:
    data = _data_file(shard, 3)
    data.write_bytes(data.read_bytes()[:100])


def _extend_data(shard: Path) -> None:
    data = _data_file(shard, 3)
    data.write_bytes(data.read_bytes() + b"\0")


def _delete_data(shard: Path) -> None:
    _data_file(shard, 3).unlink()


def _delete_manifest(shard: Path) -> None:
    _manifest(shard, 3).unlink()


def _garble_manifest(shard: Path) -> None:
    _manifest(shard, 3).write_text("{not json")


def _truncate_manifest(shard: Path) -> None:
    path = _manifest(shard, 3)
    path.write_bytes(path.read_bytes()[:-40])


def _edit_manifest_step(shard: Path) -> None:
    # Valid JSON, plausible content, but not what was written: the manifest's own
    # checksum catches it.
    path = _manifest(shard, 3)
    doc = json.loads(path.read_text())
    doc["step"] = 4
    path.write_text(json.dumps(doc))


def _empty_manifest(shard: Path) -> None:
    _manifest(shard, 3).write_bytes(b"")


DAMAGE: dict[str, Callable[[Path], None]] = {
    "flipped tensor byte": _flip_tensor_byte,
    "flipped structure byte": _flip_structure_byte,
    "truncated data": _truncate_data,
    "extended data": _extend_data,
    "missing data": _delete_data,
    "missing manifest": _delete_manifest,
    "garbled manifest": _garble_manifest,
    "truncated manifest": _truncate_manifest,
    "edited manifest": _edit_manifest_step,
    "empty manifest": _empty_manifest,
}


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_damaged_newest_falls_back_to_the_previous(
    tmp_path: Path, damage: Callable[[Path], None], caplog: pytest.LogCaptureFixture
) -> None:
    shard = _write_three(tmp_path)
    damage(shard)
    with caplog.at_level(logging.WARNING):
        restored = Checkpointer(LocalStorage(tmp_path)).restore_latest()
    assert restored is not None
    assert restored.meta.step == 2 and restored.payload["step"] == 2
    assert torch.equal(restored.payload["w"], torch.full((_SIZE,), 2.0))
    if damage is not _delete_manifest:  # without a manifest step 3 was never committed
        assert "step 3 skipped" in caplog.text


def test_a_checksum_mismatch_names_the_file(tmp_path: Path) -> None:
    shard = _write_three(tmp_path)
    _flip_tensor_byte(shard)
    with pytest.raises(CorruptCheckpoint, match=r"step-000000000003\.\w+\.data: data checksum"):
        Checkpointer(LocalStorage(tmp_path)).restore(3)


def test_all_damaged_restores_nothing_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shard = _write_three(tmp_path)
    for step in (1, 2, 3):
        _flip(_data_file(shard, step), 200)
    with caplog.at_level(logging.WARNING):
        assert Checkpointer(LocalStorage(tmp_path)).restore_latest() is None
    assert "none of the 3 checkpoints" in caplog.text


def test_damaged_checkpoints_are_removed_after_the_next_commit(tmp_path: Path) -> None:
    # Training resumed from step 1; the damaged steps 2 and 3 lie above every new step
    # for a while and must neither be restored nor crowd new checkpoints out of `keep`.
    shard = _write_three(tmp_path)
    _flip(_data_file(shard, 2), 10)
    _truncate_data(shard)
    ckpt = Checkpointer(LocalStorage(tmp_path), keep=2)
    restored = ckpt.restore_latest()
    assert restored is not None and restored.meta.step == 1
    ckpt.save(2, {"w": torch.zeros(1), "step": 2})
    ckpt.flush()
    assert ckpt.steps() == [1, 2]
    assert Checkpointer(LocalStorage(tmp_path)).restore(2).payload["step"] == 2


class _FailingReads(LocalStorage):
    """Local storage on which reading one file fails with an I/O error."""

    def __init__(self, root: Path, broken: str) -> None:
        super().__init__(root)
        self.broken = broken

    def open_read(self, name: str) -> ReadStream:
        if name.endswith(self.broken):
            raise OSError(errno.EIO, "Input/output error")
        return super().open_read(name)


def test_unreadable_checkpoints_are_skipped_but_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # An I/O error says nothing about the content, so the checkpoint is not removed.
    shard = _write_three(tmp_path)
    ckpt = Checkpointer(_FailingReads(tmp_path, _data_file(shard, 3).name), keep=5)
    with caplog.at_level(logging.WARNING):
        restored = ckpt.restore_latest()
    assert restored is not None and restored.meta.step == 2
    assert "Input/output error" in caplog.text
    ckpt.save(4, {"step": 4})
    ckpt.flush()
    assert ckpt.steps() == [1, 2, 3, 4]


def test_a_structure_that_calls_code_is_refused(tmp_path: Path) -> None:
    # A file someone planted with valid checksums must still not run code on load.
    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (print, ("pwned",))

    shard = _write_three(tmp_path)
    manifest_path = _manifest(shard, 3)
    manifest = Manifest.from_json(manifest_path.read_bytes())
    tensors_end = manifest.objects_offset
    data = _data_file(shard, 3)
    planted = data.read_bytes()[:tensors_end] + pickle.dumps({"w": Payload()})
    data.write_bytes(planted)
    rebuilt = dataclasses.replace(
        manifest,
        data_size=len(planted),
        checksum=f"crc32:{zlib.crc32(planted):08x}",
        objects_length=len(planted) - tensors_end,
    )
    manifest_path.write_bytes(rebuilt.to_json())
    with pytest.raises(CorruptCheckpoint, match=r"refers to builtins\.print"):
        Checkpointer(LocalStorage(tmp_path)).restore(3)
