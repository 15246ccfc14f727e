"""Checkpointer: exact round trips, background writes, pruning and reported failures."""

from __future__ import annotations

import collections
import errno
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from ringwright.runtime.checkpoint.checkpointer import (
    Checkpointer,
    CheckpointError,
    CheckpointMeta,
    LocalStorage,
    UnsupportedPayload,
    ps_shard,
)
from ringwright.runtime.checkpoint.storage import Bytes, StagedFile


def _training_state(seed: int) -> dict[str, Any]:
    """A payload shaped like the runtime's: model, optimizer, sampler, counters."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(5, 8)).pow(2).mean().backward()
        optimizer.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "sampler": {"epoch": 2, "position": 1234, "seed": seed},
        "counters": {"step": 42, "samples": 42 * 5},
        "world_size": 4,
        "lr": {"rule": "linear", "base_world_size": 2, "scale": 2.0},
        "rng": torch.get_rng_state(),
    }


def _assert_same(expected: Any, actual: Any, where: str = "payload") -> None:
    """Deep equality with torch.equal for tensors (and dtype, shape)."""
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual, expected.cpu()), where
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), where
        for key in expected:
            _assert_same(expected[key], actual[key], f"{where}[{key!r}]")
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), where
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            _assert_same(e, a, f"{where}[{i}]")
    else:
        assert actual == expected, where


def test_training_state_round_trips_exactly(tmp_path: Path) -> None:
    state = _training_state(seed=1)
    with Checkpointer(LocalStorage(tmp_path), keep=2) as ckpt:
        ckpt.save(42, state, {"epoch": 3, "world_size": 4, "lr_rule": "linear"})
    restored = Checkpointer(LocalStorage(tmp_path)).restore_latest()
    assert restored is not None
    assert restored.meta == CheckpointMeta(42, epoch=3, world_size=4, extra={"lr_rule": "linear"})
    _assert_same(state, restored.payload)
    # load_state_dict needs the version metadata that state_dict() attaches.
    model = restored.payload["model"]
    assert isinstance(model, collections.OrderedDict)
    assert model._metadata == state["model"]._metadata  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(24, dtype=torch.float64).reshape(2, 3, 4),
        torch.tensor(2.5, dtype=torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.randn(3, 2, dtype=torch.complex64),
        torch.arange(10, dtype=torch.int8),
        torch.tensor([1.5, -2.0], dtype=torch.float16),
        torch.empty(0, 7),
        torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
        torch.arange(20, dtype=torch.int64)[3:17:2],  # a strided view into a larger storage
        torch.complex(torch.arange(6.0), torch.ones(6)).conj(),  # lazy conjugate bit
        torch.complex(torch.arange(6.0), torch.ones(6)).conj().imag,  # lazy negative bit
        torch.nn.Parameter(torch.ones(3, 3)),  # as in state_dict(keep_vars=True)
    ],
    ids=[
        "f64-3d", "bf16-scalar", "bool", "complex", "int8", "f16", "empty", "transposed",
        "view", "conj", "neg", "parameter",
    ],
)
@pytest.mark.parametrize("copy", [True, False], ids=["copied", "handed-over"])
def test_tensor_kinds_round_trip(tmp_path: Path, tensor: torch.Tensor, copy: bool) -> None:
    with Checkpointer(LocalStorage(tmp_path)) as ckpt:
        ckpt.save(1, {"t": tensor, "after": torch.ones(5)}, copy=copy)
    restored = Checkpointer(LocalStorage(tmp_path)).restore(1)
    _assert_same({"t": tensor.detach().resolve_conj().resolve_neg(), "after": torch.ones(5)},
                 restored.payload)


def test_a_handed_over_payload_round_trips(tmp_path: Path) -> None:
    state = _training_state(seed=2)
    with Checkpointer(LocalStorage(tmp_path)) as ckpt:
        ckpt.save(9, state, {"epoch": 1}, copy=False)
    restored = Checkpointer(LocalStorage(tmp_path)).restore_latest()
    assert restored is not None and restored.meta.step == 9
    _assert_same(state, restored.payload)


def test_plain_values_and_shared_tensors_round_trip(tmp_path: Path) -> None:
    weight = torch.randn(4, 4)
    payload = {
        "tied": [weight, weight],
        "values": (None, True, 7, 2.5, 1 + 2j, "text", b"raw", bytearray(b"ba")),
        "sets": ({1, 2}, frozenset({"a"})),
        "torch": (torch.float16, torch.device("cpu"), torch.Size([2, 3])),
        "ranges": (range(2, 9, 3), slice(1, None)),
        "nested": {"a": [{"b": torch.ones(2)}]},
    }
    with Checkpointer(LocalStorage(tmp_path)) as ckpt:
        ckpt.save(5, payload)
    restored = Checkpointer(LocalStorage(tmp_path)).restore(5).payload
    assert restored["tied"][0] is restored["tied"][1]
    assert torch.equal(restored["tied"][0], weight)
    assert restored["values"] == payload["values"]
    assert restored["sets"] == payload["sets"]
    assert restored["torch"] == payload["torch"]
    assert isinstance(restored["torch"][2], torch.Size)
    assert restored["ranges"] == payload["ranges"]
    assert torch.equal(restored["nested"]["a"][0]["b"], torch.ones(2))


@pytest.mark.parametrize("checksum", ["crc32", "sha256"])
def test_both_checksums_verify(tmp_path: Path, checksum: str) -> None:
    with Checkpointer(LocalStorage(tmp_path), checksum=checksum) as ckpt:
        ckpt.save(3, {"x": torch.arange(100)})
    manifest = (tmp_path / "model" / "step-000000000003.manifest.json").read_text()
    assert f'"checksum": "{checksum}:' in manifest
    assert torch.equal(Checkpointer(LocalStorage(tmp_path)).restore(3).payload["x"],
                       torch.arange(100))


class _GatedStorage(LocalStorage):
    """Local storage whose data writes wait until the test opens the gate."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def create(self, name: str) -> StagedFile:
        staged = super().create(name)
        if not name.endswith(".data"):
            return staged
        storage = self

        class Gated:
            def write(self, data: Bytes) -> None:
                storage.entered.set()
                assert storage.gate.wait(60), "test never opened the gate"
                staged.write(data)

            def commit(self) -> None:
                staged.commit()

            def abort(self) -> None:
                staged.abort()

        return Gated()


def test_save_returns_before_the_write_and_snapshots_the_payload(tmp_path: Path) -> None:
    storage = _GatedStorage(tmp_path)
    weights = torch.zeros(1000)
    ckpt = Checkpointer(storage)
    ckpt.save(10, {"w": weights})
    # save() has returned although the writer is held inside its first write.
    assert storage.entered.wait(60)
    assert ckpt.flush(timeout=0) is False
    assert ckpt.steps() == []
    weights += 1  # training goes on and changes the live tensors
    storage.gate.set()
    assert ckpt.close() is True
    restored = Checkpointer(LocalStorage(tmp_path)).restore_latest()
    assert restored is not None and restored.meta.step == 10
    assert torch.equal(restored.payload["w"], torch.zeros(1000))


def test_keeps_the_newest_k_and_removes_leftovers(tmp_path: Path) -> None:
    shard = tmp_path / "model"
    shard.mkdir()
    # An interrupted write of an old step, as a killed writer leaves it.
    (shard / "step-000000000001.5a5a5a5a.data.partial-0badf00d").write_bytes(b"half")
    with Checkpointer(LocalStorage(tmp_path), keep=3) as ckpt:
        for step in range(2, 9):
            ckpt.save(step, {"v": torch.full((3,), float(step))})
            ckpt.flush()
        assert ckpt.steps() == [6, 7, 8]
    files = sorted(p.name for p in shard.iterdir())
    assert len(files) == 6 and not any("partial" in f for f in files), files


def test_prune_leaves_files_of_a_newer_step_alone(tmp_path: Path) -> None:
    # Files of a step above every committed one can only be a write in flight
    # elsewhere; removing them would break it.
    shard = tmp_path / "model"
    shard.mkdir()
    in_flight = shard / "step-000000000099.0c0c0c0c.data.partial-12345678"
    in_flight.write_bytes(b"in flight")
    with Checkpointer(LocalStorage(tmp_path), keep=1) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"v": torch.ones(1)})
    assert in_flight.exists()


def test_shards_are_separate_folders(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    with Checkpointer(storage, shard=ps_shard(0)) as ps0, Checkpointer(
        storage, shard=ps_shard(1)
    ) as ps1:
        ps0.save(7, {"part": torch.zeros(2)})
        ps1.save(7, {"part": torch.ones(2)})
        ps1.save(8, {"part": torch.ones(2)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ps-0", "ps-1"]
    ps0, ps1 = Checkpointer(storage, shard="ps-0"), Checkpointer(storage, shard="ps-1")
    common = max(set(ps0.steps()) & set(ps1.steps()))
    assert common == 7
    assert torch.equal(ps1.restore(common).payload["part"], torch.ones(2))


def test_empty_storage_restores_nothing(tmp_path: Path) -> None:
    assert Checkpointer(LocalStorage(tmp_path / "never-written")).restore_latest() is None


def test_restore_of_a_missing_step_says_where_it_looked(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*step-000000000004"):
        Checkpointer(LocalStorage(tmp_path)).restore(4)


class _Unsaveable:
    pass


@pytest.mark.parametrize(
    ("value", "named"),
    [
        (_Unsaveable(), "_Unsaveable"),
        (lambda: 1, "function"),
        (collections.Counter(a=1), "Counter"),
        (torch.zeros(3).to_sparse(), "sparse"),
    ],
    ids=["class", "lambda", "dict-subclass", "sparse"],
)
def test_unsupported_values_fail_at_save_with_a_reason(
    tmp_path: Path, value: object, named: str
) -> None:
    ckpt = Checkpointer(LocalStorage(tmp_path))
    with pytest.raises(UnsupportedPayload, match=named):
        ckpt.save(1, {"sampler": {"state": value}})
    assert ckpt.close() is True
    assert ckpt.steps() == []


def test_metadata_is_checked_at_save(tmp_path: Path) -> None:
    ckpt = Checkpointer(LocalStorage(tmp_path))
    with pytest.raises(ValueError, match="metadata for step 3"):
        ckpt.save(4, {}, CheckpointMeta(3))
    with pytest.raises(UnsupportedPayload, match="JSON"):
        ckpt.save(4, {}, {"note": object()})
    with pytest.raises(ValueError, match="world_size=0"):
        ckpt.save(4, {}, {"world_size": 0})
    ckpt.close()
    with pytest.raises(CheckpointError, match="closed"):
        ckpt.save(5, {})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep": 0}, "keep must be at least 1"),
        ({"shard": "../up"}, "shard name"),
        ({"checksum": "md5"}, "unknown checksum"),
    ],
)
def test_bad_settings_are_refused(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Checkpointer(LocalStorage(tmp_path), **kwargs)


class _FullDisk(LocalStorage):
    """Local storage that runs out of space while writing data files."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.full = False

    def create(self, name: str) -> StagedFile:
        staged = super().create(name)
        storage = self

        class Failing:
            def write(self, data: Bytes) -> None:
                if storage.full:
                    raise OSError(errno.ENOSPC, "No space left on device")
                staged.write(data)

            def commit(self) -> None:
                staged.commit()

            def abort(self) -> None:
                staged.abort()

        return Failing()


def test_a_failed_write_is_reported_once_and_loses_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    storage = _FullDisk(tmp_path)
    ckpt = Checkpointer(storage)
    ckpt.save(1, {"v": torch.ones(4)})
    assert ckpt.flush()
    storage.full = True
    with caplog.at_level(logging.ERROR):
        ckpt.save(2, {"v": torch.ones(4) * 2})
        with pytest.raises(CheckpointError, match="No space left on device"):
            ckpt.flush()
    assert "step 2 could not be written" in caplog.text
    assert ckpt.flush() is True  # reported once
    assert not [p for p in (tmp_path / "model").iterdir() if "partial" in p.name]
    storage.full = False
    ckpt.save(3, {"v": torch.ones(4) * 3})
    ckpt.close()
    assert ckpt.steps() == [1, 3]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_snapshotted_through_pinned_memory(tmp_path: Path) -> None:
    weights = torch.randn(1 << 20, device="cuda")
    expected = weights.cpu()
    ckpt = Checkpointer(LocalStorage(tmp_path))
    ckpt.save(1, {"w": weights, "cpu": torch.ones(3)})
    weights.zero_()  # the snapshot must already hold the old values
    ckpt.close()
    restored = Checkpointer(LocalStorage(tmp_path)).restore(1).payload
    assert restored["w"].device.type == "cpu"
    assert torch.equal(restored["w"], expected)
