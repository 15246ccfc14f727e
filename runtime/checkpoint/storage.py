"""Where checkpoint bytes live: a small storage interface and its local-filesystem form.

The checkpointer needs only a handful of operations on flat names such as
``model/step-000000000120.manifest.json``: write a file so that it appears whole or
not at all, read it back, list a folder, delete. :class:`CheckpointStorage` names them;
:class:`LocalStorage` implements them on a directory, which in a cluster is a mounted
PersistentVolumeClaim.

An ``s3://bucket/prefix`` path selects :class:`~.s3.S3Storage` instead (see
:func:`storage_for`): S3-compatible object storage, where an object becomes visible only
when its upload completes.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from types import TracebackType
from typing import Protocol, Self

Bytes = bytes | bytearray | memoryview
"""Anything a staged file accepts in :meth:`StagedFile.write`."""

PARTIAL_MARKER = ".partial-"
"""Infix of a staged file's temporary name: ``<name>.partial-<random>``.

A writer killed mid-write leaves such files behind. Their names start with the name
they were meant to get, so the checkpointer can attribute them to a step and remove them.
"""


class ReadStream(Protocol):
    """A file opened for reading (a context manager that closes it)."""

    def read(self, size: int = -1, /) -> bytes: ...

    def readinto(self, buffer: memoryview, /) -> int: ...

    def __enter__(self) -> Self: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
        /,
    ) -> object: ...


class StagedFile(Protocol):
    """A file being written; it becomes visible under its name only on :meth:`commit`."""

    def write(self, data: Bytes) -> None:
        """Append ``data``; raises OSError when the storage refuses it (e.g. disk full)."""
        ...

    def commit(self) -> None:
        """Make the bytes durable, then publish them under the final name atomically."""
        ...

    def abort(self) -> None:
        """Drop what was written; the final name is left as it was. Safe to call twice."""
        ...


class CheckpointStorage(Protocol):
    """The operations the checkpointer needs, on ``/``-separated names relative to a root."""

    def create(self, name: str) -> StagedFile:
        """Start writing ``name``; readers keep seeing the old content (or none) until commit."""
        ...

    def open_read(self, name: str) -> ReadStream:
        """Open ``name`` for reading; raises FileNotFoundError when it does not exist."""
        ...

    def size(self, name: str) -> int:
        """Size of ``name`` in bytes; raises FileNotFoundError when it does not exist."""
        ...

    def listdir(self, folder: str) -> list[str]:
        """Names of the files directly in ``folder`` (full names, e.g. ``model/x``).

        Includes leftovers of aborted or interrupted writes (see :data:`PARTIAL_MARKER`),
        so that their owner can clean them up. An absent folder lists as empty.
        """
        ...

    def delete(self, name: str) -> None:
        """Remove ``name``; a name that is already gone is not an error."""
        ...

    def describe(self, name: str) -> str:
        """Where ``name`` lives, for messages a person reads (a path or a URL)."""
        ...


def check_name(name: str) -> None:
    """Refuse a storage name that is absolute, empty or climbs out of the root."""
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(
            f"storage name {name!r} must be relative, '/'-separated, without '.' or '..'"
        )


def storage_for(path: str) -> CheckpointStorage:
    """The storage a job's ``spec.checkpoint.path`` names: ``s3://...`` or a directory."""
    if path.startswith("s3://"):
        # Imported here: boto3 is needed only by jobs that checkpoint to object storage.
        from .s3 import S3Storage

        return S3Storage(path)
    return LocalStorage(path)


def _fsync_dir(path: Path) -> None:
    # A rename or a new entry is durable only once the directory itself is synced.
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _LocalStagedFile:
    """A temporary file next to the target, fsynced and renamed over it on commit."""

    def __init__(self, final: Path) -> None:
        self._final = final
        self._temp = final.with_name(f"{final.name}{PARTIAL_MARKER}{secrets.token_hex(4)}")
        # O_EXCL: the random suffix makes a clash unlikely; this makes it impossible for two
        # writers to share a temporary file.
        self._fd: int | None = os.open(
            self._temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644
        )

    def write(self, data: Bytes) -> None:
        if self._fd is None:
            raise ValueError(f"write to {self._final} after commit or abort")
        view = memoryview(data).cast("B")
        while view:
            written = os.write(self._fd, view)
            view = view[written:]

    def commit(self) -> None:
        if self._fd is None:
            raise ValueError(f"commit of {self._final} after commit or abort")
        fd, self._fd = self._fd, None
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.replace(self._temp, self._final)
        except OSError:
            self._remove_temp()
            raise
        _fsync_dir(self._final.parent)

    def abort(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        self._remove_temp()

    def _remove_temp(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._temp.unlink()


class LocalStorage:
    """Checkpoint storage in a local directory (a mounted PersistentVolumeClaim in a pod).

    Every committed file went through write-to-temporary, fsync, rename, fsync of the
    directory, so after a crash or power loss a name holds either its complete old
    content or its complete new content.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        if not os.fspath(root):
            # Path("") is the working directory: checkpoints would land wherever the
            # process happened to start.
            raise ValueError("checkpoint storage needs a directory (the job's checkpoint path)")
        self.root = Path(root)

    def _path(self, name: str) -> Path:
        check_name(name)
        return self.root.joinpath(*name.split("/"))

    def _make_parents(self, path: Path) -> None:
        # Create missing folders top-down and sync each parent, so that a folder created
        # just before a crash does not vanish with the file committed into it.
        missing: list[Path] = []
        folder = path.parent
        while not folder.is_dir():
            missing.append(folder)
            folder = folder.parent
        for created in reversed(missing):
            with contextlib.suppress(FileExistsError):
                created.mkdir()
            _fsync_dir(created.parent)

    def create(self, name: str) -> StagedFile:
        """Start a staged write of ``name`` (see :class:`StagedFile`)."""
        path = self._path(name)
        self._make_parents(path)
        return _LocalStagedFile(path)

    def open_read(self, name: str) -> ReadStream:
        """Open ``name`` for binary reading."""
        return self._path(name).open("rb")

    def size(self, name: str) -> int:
        """Size of ``name`` in bytes."""
        return self._path(name).stat().st_size

    def listdir(self, folder: str) -> list[str]:
        """Files directly in ``folder``, sorted; empty when the folder does not exist."""
        try:
            entries = list(os.scandir(self._path(folder)))
        except FileNotFoundError:
            return []
        prefix = folder.rstrip("/")
        return sorted(f"{prefix}/{e.name}" for e in entries if e.is_file(follow_symlinks=False))

    def delete(self, name: str) -> None:
        """Remove ``name`` if it exists."""
        with contextlib.suppress(FileNotFoundError):
            self._path(name).unlink()

    def describe(self, name: str) -> str:
        """The absolute path of ``name``."""
        return str(self._path(name).absolute())
