"""Checkpoints in S3-compatible object storage, against a real server (MinIO).

The storage contract holds for both storages (the same tests run on a directory and on a
bucket), and the checkpointer's guarantees hold on a bucket: verify on restore, the
newest good checkpoint wins, keep N, and leftovers of an interrupted write are removed,
multipart uploads included.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ringwright.runtime.checkpoint.checkpointer import Checkpointer
from ringwright.runtime.checkpoint.s3 import MIN_PART_SIZE, S3Storage, parse_url
from ringwright.runtime.checkpoint.storage import (
    PARTIAL_MARKER,
    CheckpointStorage,
    LocalStorage,
    storage_for,
)
from tests.s3 import S3Bucket

MakeStorage = Callable[[], CheckpointStorage]


@pytest.fixture(params=["local", "s3"])
def make_storage(request: pytest.FixtureRequest, tmp_path: Path) -> MakeStorage:
    """A factory of storages on one root: a directory or a bucket's prefix."""
    if request.param == "local":
        return lambda: LocalStorage(tmp_path / "root")
    bucket: S3Bucket = request.getfixturevalue("s3_bucket")
    return lambda: S3Storage(bucket.url("root"), part_size=MIN_PART_SIZE)


def read(storage: CheckpointStorage, name: str) -> bytes:
    with storage.open_read(name) as stream:
        return stream.read()


def committed(storage: CheckpointStorage, name: str, data: bytes) -> None:
    staged = storage.create(name)
    staged.write(data)
    staged.commit()


BIG = bytes(range(256)) * (MIN_PART_SIZE * 2 // 256 + 1000)
"""More than two parts: uploaded as a multipart upload on S3."""


@pytest.mark.parametrize("size", [11, len(BIG)], ids=["one-put", "multipart"])
def test_commit_publishes_and_replaces_atomically(make_storage: MakeStorage, size: int) -> None:
    storage = make_storage()
    committed(storage, "a/b/file", b"old")
    new = BIG[:size]
    staged = storage.create("a/b/file")
    staged.write(memoryview(new)[: size // 2])
    staged.write(new[size // 2 :])
    # Until commit readers see the old content, whole.
    assert read(storage, "a/b/file") == b"old"
    staged.commit()
    assert read(storage, "a/b/file") == new
    assert storage.size("a/b/file") == size
    assert storage.listdir("a/b") == ["a/b/file"]
    with pytest.raises(ValueError, match="after commit or abort"):
        staged.write(b"more")
    staged.abort()  # after commit: nothing to drop, the file stays
    assert read(storage, "a/b/file") == new


@pytest.mark.parametrize("size", [7, len(BIG)], ids=["one-put", "multipart"])
def test_abort_leaves_nothing(make_storage: MakeStorage, size: int) -> None:
    storage = make_storage()
    staged = storage.create("x/file")
    staged.write(BIG[:size])
    staged.abort()
    staged.abort()
    assert storage.listdir("x") == []
    with pytest.raises(ValueError, match="after commit or abort"):
        staged.write(b"more")
    with pytest.raises(FileNotFoundError):
        storage.open_read("x/file")
    with pytest.raises(FileNotFoundError):
        storage.size("x/file")


def test_reads_stream_into_buffers(make_storage: MakeStorage) -> None:
    storage = make_storage()
    committed(storage, "f", BIG)
    target = bytearray(len(BIG) + 10)
    with storage.open_read("f") as stream:
        assert stream.read(5) == BIG[:5]
        assert stream.readinto(memoryview(target)) == len(BIG) - 5
    assert bytes(target[: len(BIG) - 5]) == BIG[5:]


def test_listing_and_deleting_absent_things_is_quiet(make_storage: MakeStorage) -> None:
    storage = make_storage()
    assert storage.listdir("nothing-here") == []
    storage.delete("nothing-here/file")
    committed(storage, "d/f", b"")
    committed(storage, "d/sub/g", b"x")
    assert storage.listdir("d") == ["d/f"]  # folders are not files
    storage.delete("d/f")
    assert storage.listdir("d") == []


@pytest.mark.parametrize("name", ["", "/abs", "a/../b", "a//b", "./a"])
def test_names_must_stay_under_the_root(make_storage: MakeStorage, name: str) -> None:
    with pytest.raises(ValueError, match="must be relative"):
        make_storage().create(name)


def test_describe_gives_a_url(s3_bucket: S3Bucket) -> None:
    storage = S3Storage(f"s3://{s3_bucket.name}/jobs/a/")
    assert storage.describe("m/f") == f"s3://{s3_bucket.name}/jobs/a/m/f"
    committed(storage, "m/f", b"1")
    assert s3_bucket.keys() == ["jobs/a/m/f"]
    assert S3Storage(f"s3://{s3_bucket.name}").describe("m/f") == f"s3://{s3_bucket.name}/m/f"


def test_the_path_picks_the_storage(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    assert isinstance(storage_for(s3_bucket.url()), S3Storage)
    assert isinstance(storage_for(str(tmp_path)), LocalStorage)
    assert parse_url("s3://b/x/y/") == ("b", "x/y/")
    with pytest.raises(ValueError, match="names no bucket"):
        parse_url("s3:///x")


def test_a_missing_bucket_is_an_os_error_that_names_it(s3_bucket: S3Bucket) -> None:
    storage = S3Storage("s3://no-such-bucket-here/x")
    with pytest.raises(OSError, match="s3://no-such-bucket-here/x/f"):
        committed(storage, "f", b"data")


def test_an_interrupted_upload_is_listed_and_its_removal_aborts_it(s3_bucket: S3Bucket) -> None:
    storage = S3Storage(s3_bucket.url("root"), part_size=MIN_PART_SIZE)
    staged = storage.create("shard/file")
    staged.write(BIG)  # two parts uploaded, then the writer dies without commit or abort
    (marker,) = storage.listdir("shard")
    assert marker.startswith("shard/file" + PARTIAL_MARKER)
    assert s3_bucket.uploads("root/shard/file"), "the parts wait in an unfinished upload"
    storage.delete(marker)
    assert storage.listdir("shard") == []
    assert s3_bucket.uploads("root/shard/file") == []


def save(ckpt: Checkpointer, step: int) -> None:
    ckpt.save(step, {"step": step, "w": torch.full((64, 64), float(step))})
    assert ckpt.flush(60), "the write finished"


def test_checkpoints_keep_the_newest_k_and_restore_the_newest(s3_bucket: S3Bucket) -> None:
    url = s3_bucket.url("job")
    with Checkpointer(storage_for(url), keep=2) as ckpt:
        for step in (1, 2, 3, 4):
            save(ckpt, step)
    reader = Checkpointer(storage_for(url))
    assert reader.steps() == [3, 4]
    restored = reader.restore_latest()
    assert restored is not None
    assert restored.payload["step"] == 4
    assert torch.equal(restored.payload["w"], torch.full((64, 64), 4.0))
    # Only the kept checkpoints' files remain: one manifest and one data object each.
    assert len(s3_bucket.keys("job/")) == 4


def test_a_damaged_newest_falls_back_and_is_removed_after_the_next_commit(
        s3_bucket: S3Bucket) -> None:
    url = s3_bucket.url("job")
    with Checkpointer(storage_for(url), keep=3) as ckpt:
        for step in (1, 2):
            save(ckpt, step)
    (data_key,) = [k for k in s3_bucket.keys("job/") if "step-000000000002" in k
                   and k.endswith(".data")]
    body = s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=data_key)["Body"].read()
    damaged = bytearray(body)
    damaged[len(damaged) // 2] ^= 0xFF
    s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=data_key, Body=bytes(damaged))

    ckpt = Checkpointer(storage_for(url), keep=3)
    restored = ckpt.restore_latest()
    assert restored is not None
    assert restored.payload["step"] == 1, "verification caught the flipped byte"
    save(ckpt, 3)
    ckpt.close()
    assert Checkpointer(storage_for(url)).steps() == [1, 3]
    assert not [k for k in s3_bucket.keys("job/") if "step-000000000002" in k]


def test_leftovers_of_an_interrupted_write_are_removed_by_the_next_commit(
        s3_bucket: S3Bucket) -> None:
    url = s3_bucket.url("job")
    storage = S3Storage(url, part_size=MIN_PART_SIZE)
    with Checkpointer(storage, keep=2) as ckpt:
        save(ckpt, 1)
    # A writer killed while uploading step 2's data: a marker and an unfinished upload.
    dead = storage.create("model/step-000000000002.dead.data")
    dead.write(BIG)
    assert any(PARTIAL_MARKER in n for n in storage.listdir("model"))
    with Checkpointer(storage_for(url), keep=2) as ckpt:
        save(ckpt, 3)
    assert not [n for n in storage.listdir("model") if "step-000000000002" in n]
    assert s3_bucket.uploads("job/model/step-000000000002.dead.data") == []
    assert Checkpointer(storage_for(url)).steps() == [1, 3]
