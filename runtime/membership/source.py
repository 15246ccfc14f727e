"""Where a runtime learns its job's world: one interface, several sources.

A source only reports worlds; deciding what to do with them (join, leave, rebuild)
belongs to the group manager. Sources never go back in time: a world whose generation is
not newer than the last one seen is ignored, so a stale document cannot undo a
membership change.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from ringwright.world import World

from ..kvlog import log_event, runtime_logger

_log = runtime_logger("membership")


SIGNAL_CHECK_S = 0.2
"""Longest a wait for a world blocks before the waiting thread checks for signals."""


class WorldTimeout(TimeoutError):
    """No suitable world arrived in time."""


class MembershipSource(Protocol):
    """The job's world as published by the operator (or a local stand-in)."""

    def latest(self) -> World | None:
        """The newest world seen so far, without blocking; None before the first one."""
        ...

    def wait_for_world(self, after_generation: int, timeout: float) -> World:
        """Block until a world with ``generation > after_generation`` is known and return
        the newest.

        Raises :class:`WorldTimeout` after ``timeout`` seconds.
        """
        ...

    def close(self) -> None:
        """Stop watching; safe to call more than once."""
        ...


class WorldBox:
    """The newest world, shared between a watcher thread and the training thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._cond = threading.Condition()
        self._world: World | None = None
        self._clock = clock

    def latest(self) -> World | None:
        """The newest world offered so far."""
        with self._cond:
            return self._world

    def offer(self, world: World, where: str) -> bool:
        """Keep ``world`` when it is newer than the current one; True when kept."""
        with self._cond:
            if self._world is not None and world.generation <= self._world.generation:
                if world.generation < self._world.generation:
                    log_event(_log, logging.WARNING, "world_ignored_stale", where=where,
                              generation=world.generation, newest=self._world.generation)
                return False
            self._world = world
            self._cond.notify_all()
        log_event(_log, logging.INFO, "world_seen", where=where, generation=world.generation,
                  size=world.size, store=f"{world.store.address}:{world.store.port}")
        return True

    def wait_newer(self, after_generation: int, timeout: float) -> World:
        """Block until a world newer than ``after_generation`` has been offered."""
        deadline = self._clock() + timeout
        with self._cond:
            while self._world is None or self._world.generation <= after_generation:
                left = deadline - self._clock()
                if left <= 0:
                    raise WorldTimeout(
                        f"no world newer than generation {after_generation} within {timeout:.0f}s"
                    )
                # In slices: a signal delivered to another thread runs its Python
                # handler (SIGTERM: stop waiting) only once this thread wakes up.
                self._cond.wait(min(left, SIGNAL_CHECK_S))
            return self._world
