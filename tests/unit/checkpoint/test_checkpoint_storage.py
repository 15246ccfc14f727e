"""LocalStorage: a staged file is invisible until committed and leaves nothing if aborted."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringwright.runtime.checkpoint.storage import PARTIAL_MARKER, LocalStorage


def test_commit_publishes_and_replaces_atomically(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    first = storage.create("a/b/file")
    first.write(b"old")
    first.commit()
    second = storage.create("a/b/file")
    second.write(memoryview(b"new content"))
    # Until commit the old content stays in place; the new bytes sit in a partial file.
    with storage.open_read("a/b/file") as stream:
        assert stream.read() == b"old"
    (partial,) = [n for n in storage.listdir("a/b") if PARTIAL_MARKER in n]
    assert partial.startswith("a/b/file" + PARTIAL_MARKER)
    second.commit()
    with storage.open_read("a/b/file") as stream:
        assert stream.read() == b"new content"
    assert storage.listdir("a/b") == ["a/b/file"]
    assert storage.size("a/b/file") == len(b"new content")


def test_abort_leaves_nothing(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    staged = storage.create("x/file")
    staged.write(b"partial")
    staged.abort()
    staged.abort()
    assert storage.listdir("x") == []
    with pytest.raises(ValueError, match="after commit or abort"):
        staged.write(b"more")
    with pytest.raises(FileNotFoundError):
        storage.open_read("x/file")


def test_listing_and_deleting_absent_things_is_quiet(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    assert storage.listdir("nothing-here") == []
    storage.delete("nothing-here/file")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "sub").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"")
    assert storage.listdir("d") == ["d/f"]  # folders are not files


@pytest.mark.parametrize("name", ["", "/abs", "a/../b", "a//b", "./a"])
def test_names_must_stay_under_the_root(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="must be relative"):
        LocalStorage(tmp_path).create(name)


def test_an_empty_root_is_refused() -> None:
    with pytest.raises(ValueError, match="needs a directory"):
        LocalStorage("")


def test_describe_gives_the_path(tmp_path: Path) -> None:
    assert LocalStorage(tmp_path).describe("m/f") == str(tmp_path / "m" / "f")
