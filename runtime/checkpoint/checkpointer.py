"""Asynchronous, atomic, verified checkpoints of the training state.

:class:`Checkpointer` is what the runtime's State calls. ``save()`` copies the payload
(model and optimizer state_dicts, sampler state, counters, world size, LR-scaling state:
nested dicts and lists of tensors and plain values) into host memory and returns; a
background thread writes it. Training stalls only for that copy. ``restore_latest()``
returns the newest checkpoint that verifies, skipping broken ones with a warning.

Who writes
    Never two writers for one shard. In all-reduce mode every rank holds the same
    state, so only rank 0 of the current generation constructs a Checkpointer with the
    default shard :data:`MODEL_SHARD` and calls ``save()``; any rank may restore. In
    parameter-server mode each PS writes its own shard, named by :func:`ps_shard`, and a
    restore picks a step every shard has (:meth:`Checkpointer.steps`,
    :meth:`Checkpointer.restore`). Should a stray second writer appear anyway (say, an
    old rank 0 finishing its last step), it cannot corrupt a committed checkpoint:
    every attempt writes files under fresh random names and commits by renaming its
    manifest, and pruning never touches a step newer than every committed one.

On-disk layout (under the storage root, e.g. the mounted volume)::

    <shard>/step-000000000120.manifest.json     commit record, written last
    <shard>/step-000000000120.3fa2c1d0.data     tensor bytes + payload structure
    <shard>/step-000000000130.*.partial-*       an interrupted write; removed by the
                                                next commit of this shard

See :mod:`ringwright.runtime.checkpoint.snapshot` for how a save stalls training,
:mod:`ringwright.runtime.checkpoint.format` for the file contents,
:mod:`ringwright.runtime.checkpoint.storage` for the storage interface and
:mod:`ringwright.runtime.checkpoint.policy` for when to checkpoint (intervals, SIGTERM).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from .format import (
    CHECKSUMS,
    CheckpointError,
    CheckpointMeta,
    CorruptCheckpoint,
    Manifest,
    UnsupportedPayload,
    read_payload,
)
from .policy import CheckpointPolicy, TerminationSignal
from .snapshot import HostBuffer, Snapshot, take_snapshot, write_data
from .storage import CheckpointStorage, LocalStorage

__all__ = [
    "MODEL_SHARD",
    "WRITER_NICE",
    "CheckpointError",
    "CheckpointMeta",
    "CheckpointPolicy",
    "CheckpointStorage",
    "Checkpointer",
    "CorruptCheckpoint",
    "LocalStorage",
    "Restored",
    "TerminationSignal",
    "UnsupportedPayload",
    "ps_shard",
]

MODEL_SHARD = "model"
"""The shard of the single writer in all-reduce mode (rank 0)."""

_SHARD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_STEP_FILE = re.compile(r"step-(\d+)\.")
_MANIFEST_FILE = re.compile(r"step-(\d+)\.manifest\.json")


def ps_shard(index: int) -> str:
    """Shard name of parameter server ``index``; each PS writes only its own shard."""
    if index < 0:
        raise ValueError(f"parameter-server index must be >= 0, got {index}")
    return f"ps-{index}"


class Restored(NamedTuple):
    """A verified checkpoint: its metadata and its payload with tensors on the CPU."""

    meta: CheckpointMeta
    payload: dict[str, Any]


def _coerce_meta(step: int, meta: CheckpointMeta | Mapping[str, Any] | None) -> CheckpointMeta:
    if isinstance(meta, CheckpointMeta):
        if meta.step != step:
            raise ValueError(f"save(step={step}) was given metadata for step {meta.step}")
        result = meta
    else:
        fields = dict(meta or {})
        if fields.pop("step", step) != step:
            raise ValueError(f"save(step={step}) was given metadata for another step")
        extra = dict(fields.pop("extra", {}))
        epoch = fields.pop("epoch", 0)
        world_size = fields.pop("world_size", 1)
        # Any other key is kept rather than dropped: it is the caller's to read back.
        result = CheckpointMeta(step, int(epoch), int(world_size), {**fields, **extra})
    if result.step < 0 or result.epoch < 0 or result.world_size < 1:
        raise ValueError(f"checkpoint metadata out of range: {result}")
    try:
        json.dumps(dict(result.extra))
    except (TypeError, ValueError) as exc:
        raise UnsupportedPayload(f"checkpoint metadata extra must be JSON values: {exc}") from exc
    return result


def _lower_thread_priority(nice: int) -> None:
    """Lower the calling thread's CPU priority, so a write never starves training.

    On Linux a priority set for a thread id applies to that thread only; raising one's
    own niceness needs no privilege. Elsewhere the write runs at normal priority.
    """
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    thread = threading.get_native_id()
    with contextlib.suppress(OSError):
        # Only ever lower it: a process already running nicer stays as nice.
        if os.getpriority(os.PRIO_PROCESS, thread) < nice:
            os.setpriority(os.PRIO_PROCESS, thread, nice)


WRITER_NICE = 10
"""Default niceness of the background writer thread (see ``Checkpointer.writer_nice``)."""


class CheckpointWritten(NamedTuple):
    """One checkpoint committed to storage, for listeners (metrics)."""

    step: int
    nbytes: int
    stall_s: float
    """How long taking the snapshot held up training."""
    write_s: float
    """How long the background write took."""


class Checkpointer:
    """Saves payloads in the background and restores the newest one that verifies.

    Use from one thread (the training loop). At most one write is in flight: a
    ``save()`` while the previous write is still running waits for it, and says so in
    the log, because the checkpoint interval is then shorter than the write time.
    Memory: one host copy of the state, kept between checkpoints (pinned when the state
    is on a GPU) so that later snapshots copy without allocating.

    ``clock`` stamps manifests (wall time, for people); ``logger`` gets one line per
    commit, warnings for skipped checkpoints and errors for failed writes.
    """

    def __init__(
        self,
        storage: CheckpointStorage,
        keep: int = 3,
        *,
        shard: str = MODEL_SHARD,
        checksum: str = "crc32",
        writer_nice: int = WRITER_NICE,
        clock: Callable[[], float] = time.time,
        logger: logging.Logger | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1 checkpoint, got {keep}")
        if not _SHARD_NAME.fullmatch(shard):
            raise ValueError(
                f"shard name {shard!r} must be 1-63 letters, digits, '.', '_' or '-',"
                " starting with a letter or digit"
            )
        if checksum not in CHECKSUMS:
            raise ValueError(f"unknown checksum {checksum!r}; use one of {', '.join(CHECKSUMS)}")
        self.storage = storage
        self.keep = keep
        self.shard = shard
        self.checksum = checksum
        self.writer_nice = writer_nice
        """Niceness of the writer thread (Linux schedules each thread on its own): at 10
        a busy training thread outweighs it about 9 to 1, so the write takes mostly idle
        CPU yet still finishes on a saturated machine; 0 competes as an equal."""
        self._clock = clock
        self._log = logger or logging.getLogger(__name__)
        self._buffer = HostBuffer()
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        # Steps whose content failed verification in restore: they count for nothing
        # when pruning and are removed once a newer checkpoint is committed.
        self._invalid: set[int] = set()
        self._last_saved: int | None = None
        self._closed = False
        self._listeners: list[Callable[[CheckpointWritten], None]] = []

    def add_listener(self, listener: Callable[[CheckpointWritten], None]) -> None:
        """Call ``listener`` (from the writer thread) after every committed write."""
        self._listeners.append(listener)

    @property
    def last_saved_step(self) -> int | None:
        """The step of the latest ``save()`` call (written or still being written)."""
        return self._last_saved

    # --- writing ----------------------------------------------------------------------

    def save(
        self,
        step: int,
        payload: Mapping[str, Any],
        meta: CheckpointMeta | Mapping[str, Any] | None = None,
        *,
        copy: bool = True,
    ) -> None:
        """Snapshot ``payload`` into host memory and write it in the background.

        ``meta`` is a :class:`CheckpointMeta` or a mapping with ``epoch``,
        ``world_size`` and further JSON values (kept in ``extra``). Returns once the
        snapshot is taken: the caller may change its tensors right away.

        ``copy=False`` skips copying CPU tensors and writes them from where they are:
        for a payload that is already a private host copy which nothing changes until
        the write is done (the next ``save()`` or ``flush()`` returns), such as a
        State's committed snapshot. GPU tensors are copied either way.

        Raises :class:`UnsupportedPayload` for objects a checkpoint does not store, and
        :class:`CheckpointError` if the previous write failed (reported once).
        """
        if self._closed:
            raise CheckpointError("save() on a closed Checkpointer")
        checked = _coerce_meta(step, meta)
        if self._writer is not None:
            if self._writer.is_alive():
                self._log.warning(
                    "checkpoint %s: step %d waits for the previous write to finish;"
                    " the checkpoint interval is shorter than a write",
                    self.shard, step,
                )
            self._writer.join()
            self._writer = None
        self._raise_failed_write()
        started = time.perf_counter()
        snapshot = take_snapshot(payload, self._buffer, copy=copy)
        stall = time.perf_counter() - started
        self._last_saved = step
        self._invalid.discard(step)
        self._writer = threading.Thread(
            target=self._write,
            args=(checked, snapshot, stall),
            name=f"checkpoint-writer-{self.shard}",
            # Not a daemon: an interpreter that exits normally finishes the write first.
            daemon=False,
        )
        self._writer.start()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: no limit) for the pending write.

        Returns True when nothing is left to write, False when the write is still
        running. Raises :class:`CheckpointError` if that write failed.
        """
        writer = self._writer
        if writer is not None:
            writer.join(timeout)
            if writer.is_alive():
                return False
            self._writer = None
        self._raise_failed_write()
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Flush (see :meth:`flush`), then release the host buffer; returns flush's answer."""
        try:
            return self.flush(timeout)
        finally:
            self._closed = True
            self._buffer.release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _raise_failed_write(self) -> None:
        with self._error_lock:
            error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(f"writing checkpoint {self.shard} failed: {error}") from error

    def _write(self, meta: CheckpointMeta, snapshot: Snapshot, stall: float) -> None:
        _lower_thread_priority(self.writer_nice)
        started = time.perf_counter()
        try:
            self._write_files(meta, snapshot)
        except Exception as exc:
            self._log.exception(
                "checkpoint %s step %d could not be written to %s",
                self.shard, meta.step, self.storage.describe(self.shard),
            )
            with self._error_lock:
                self._error = exc
            return
        written = CheckpointWritten(meta.step, snapshot.nbytes, stall,
                                    time.perf_counter() - started)
        self._log.info(
            "checkpoint %s step %d committed: %.1f MB, training stalled %.3fs, written in %.2fs",
            self.shard, meta.step, written.nbytes / 1e6, written.stall_s, written.write_s,
        )
        for listener in self._listeners:
            listener(written)
        try:
            self._prune(meta.step)
        except OSError as exc:
            # The new checkpoint is committed; old ones linger until the next prune.
            self._log.warning("checkpoint %s: pruning old checkpoints failed: %s", self.shard, exc)

    def _write_files(self, meta: CheckpointMeta, snapshot: Snapshot) -> None:
        data_file = f"step-{meta.step:012d}.{secrets.token_hex(4)}.data"
        out = self.storage.create(f"{self.shard}/{data_file}")
        try:
            checksum = write_data(snapshot, out, self.checksum)
            out.commit()
        except BaseException:
            with contextlib.suppress(OSError):
                out.abort()
            raise
        manifest = Manifest(
            meta=meta,
            shard=self.shard,
            data_file=data_file,
            data_size=snapshot.nbytes,
            checksum=checksum,
            tensors=snapshot.entries,
            objects_offset=snapshot.tensors_end,
            objects_length=len(snapshot.objects),
            created=self._clock(),
            writer={"host": socket.gethostname(), "pid": os.getpid()},
        )
        out = self.storage.create(self._manifest_name(meta.step))
        try:
            out.write(manifest.to_json())
            out.commit()
        except BaseException:
            with contextlib.suppress(OSError):
                out.abort()
            raise

    def _manifest_name(self, step: int) -> str:
        return f"{self.shard}/step-{step:012d}.manifest.json"

    def _prune(self, written: int) -> None:
        """Keep the newest ``keep`` checkpoints and the files they name; remove the rest.

        Files of a step newer than every committed one are left alone: they can only
        be an in-flight write of another writer, which pruning must not break.
        """
        by_step: dict[int, list[str]] = {}
        for name in self.storage.listdir(self.shard):
            match = _STEP_FILE.match(name.rpartition("/")[2])
            if match:
                by_step.setdefault(int(match[1]), []).append(name)
        committed = sorted(
            step for step, names in by_step.items()
            if self._manifest_name(step) in names and step not in self._invalid
        )
        kept = set(committed[-self.keep :])
        newest = committed[-1] if committed else written
        for step, names in sorted(by_step.items()):
            if step in kept:
                referenced = self._files_of(step)
                doomed = [] if referenced is None else [n for n in names if n not in referenced]
            elif step in self._invalid or step < newest:
                # The manifest goes first, so no reader sees a commit whose data is gone.
                doomed = sorted(names, key=lambda n: n != self._manifest_name(step))
            else:
                doomed = []
            for name in doomed:
                self.storage.delete(name)
            if doomed:
                self._log.debug("checkpoint %s: removed %s", self.shard, ", ".join(doomed))
        self._invalid.clear()  # every invalid step present was removed above

    def _files_of(self, step: int) -> set[str] | None:
        name = self._manifest_name(step)
        try:
            with self.storage.open_read(name) as stream:
                manifest = Manifest.from_json(stream.read())
        except (OSError, CorruptCheckpoint):
            return None  # unreadable: leave its files for a person to look at
        return {name, f"{self.shard}/{manifest.data_file}"}

    # --- reading ----------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps that have a committed manifest in this shard, oldest first (unverified)."""
        steps = []
        for name in self.storage.listdir(self.shard):
            match = _MANIFEST_FILE.fullmatch(name.rpartition("/")[2])
            if match:
                steps.append(int(match[1]))
        return sorted(steps)

    def restore(self, step: int) -> Restored:
        """Load and verify the checkpoint of ``step``.

        Raises :class:`CorruptCheckpoint` when it fails verification and
        :class:`CheckpointError` when it does not exist or cannot be read.
        """
        manifest_name = self._manifest_name(step)
        where = self.storage.describe(manifest_name)
        try:
            with self.storage.open_read(manifest_name) as stream:
                manifest = Manifest.from_json(stream.read())
        except FileNotFoundError as exc:
            raise CheckpointError(f"no checkpoint at {where}") from exc
        except OSError as exc:
            raise CheckpointError(f"cannot read {where}: {exc}") from exc
        except CorruptCheckpoint as exc:
            raise CorruptCheckpoint(f"{where}: {exc}") from exc
        if manifest.meta.step != step or manifest.shard != self.shard:
            raise CorruptCheckpoint(
                f"{where} describes step {manifest.meta.step} of shard {manifest.shard!r}"
            )
        data_name = f"{self.shard}/{manifest.data_file}"
        data_where = self.storage.describe(data_name)
        try:
            size = self.storage.size(data_name)
            if size != manifest.data_size:
                raise CorruptCheckpoint(
                    f"{data_where} has {size} bytes, its manifest says {manifest.data_size}"
                )
            with self.storage.open_read(data_name) as stream:
                payload = read_payload(stream, manifest)
        except FileNotFoundError as exc:
            raise CorruptCheckpoint(f"{data_where}, named by {where}, is missing") from exc
        except OSError as exc:
            raise CheckpointError(f"cannot read {data_where}: {exc}") from exc
        except CorruptCheckpoint as exc:
            raise CorruptCheckpoint(f"{data_where}: {exc}") from exc
        return Restored(manifest.meta, payload)

    def restore_latest(self) -> Restored | None:
        """The newest checkpoint that verifies, or None when there is none.

        A checkpoint that fails verification is skipped with a warning in favour of the
        previous one, and removed after the next commit of this Checkpointer (so call
        ``restore_latest`` and ``save`` on the same instance). One that cannot be read
        for an I/O error is skipped too, but never removed.
        """
        steps = self.steps()
        for step in reversed(steps):
            try:
                restored = self.restore(step)
            except CorruptCheckpoint as exc:
                self._invalid.add(step)
                self._log.warning("checkpoint %s step %d skipped: %s", self.shard, step, exc)
            except CheckpointError as exc:
                self._log.warning("checkpoint %s step %d skipped: %s", self.shard, step, exc)
            else:
                self._log.info(
                    "restored checkpoint %s step %d (epoch %d, world size %d) from %s",
                    self.shard, step, restored.meta.epoch, restored.meta.world_size,
                    self.storage.describe(self.shard),
                )
                return restored
        if steps:
            self._log.error(
                "none of the %d checkpoints in %s verifies (see the warnings above);"
                " starting without one",
                len(steps), self.storage.describe(self.shard),
            )
        return None
