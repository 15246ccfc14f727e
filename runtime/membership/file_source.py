"""Membership from a local JSON world file, for tests and runs without a cluster.

Whoever plays the operator writes the file with :func:`write_world_file`, which
replaces it atomically, so a reader sees either the old or the new world, never
half of one. Readers notice a change by its stat signature; a short sleep between
looks is cheap for a local file and keeps the source free of threads.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ringwright.world import ContractError, World, parse_world

from ..kvlog import log_event, runtime_logger
from .source import WorldBox, WorldTimeout

_log = runtime_logger("file_source")


def write_world_file(path: Path, world: World) -> None:
    """Publish ``world`` at ``path`` atomically (write aside, then rename over)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(world.to_json())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class FileMembershipSource:
    """Follows a world file written by :func:`write_world_file`."""

    def __init__(
        self,
        path: Path,
        *,
        poll_interval: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._path = path
        self._poll = poll_interval
        self._clock = clock
        self._sleep = sleep
        self._box = WorldBox(clock)
        self._signature: tuple[int, int, int] | None = None

    def latest(self) -> World | None:
        """The newest world in the file (re-read only when the file changed)."""
        self._refresh()
        return self._box.latest()

    def wait_for_world(self, after_generation: int, timeout: float) -> World:
        """Look at the file every poll interval until a newer world appears."""
        deadline = self._clock() + timeout
        while True:
            world = self.latest()
            if world is not None and world.generation > after_generation:
                return world
            if self._clock() >= deadline:
                raise WorldTimeout(
                    f"{self._path}: no world newer than generation {after_generation} "
                    f"within {timeout:.0f}s"
                )
            self._sleep(self._poll)

    def close(self) -> None:
        """Nothing to release: the source holds no thread and no open file."""

    def _refresh(self) -> None:
        try:
            st = os.stat(self._path)
        except FileNotFoundError:
            return
        signature = (st.st_ino, st.st_mtime_ns, st.st_size)
        if signature == self._signature:
            return
        self._signature = signature
        try:
            world = parse_world(self._path.read_text(), where=str(self._path))
        except FileNotFoundError:
            # Replaced between stat and read: the next look sees the new file.
            self._signature = None
            return
        except ContractError as err:
            # Keep following the last good world; the writer may fix the file.
            log_event(_log, logging.ERROR, "world_unreadable", path=self._path, error=err)
            return
        self._box.offer(world, str(self._path))
