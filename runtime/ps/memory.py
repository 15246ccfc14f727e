"""Keep the transport's freed message buffers in the process instead of returning them
to the system between steps.

Every pull and push allocates and frees messages of several megabytes (gRPC needs each
one as a whole ``bytes``). glibc's defaults give that memory back (``munmap`` or a trim
of the heap top) as soon as it is freed, so the next step faults every page in again:
measured on a 100 MB dense pull + push, 60,000+ page faults per step on a worker and
30,000+ on the server, about half of the CPU time of the transfer. Raising the trim
threshold keeps up to that much freed memory for reuse, and fewer arenas let a buffer
freed by one thread serve the next message on another (gRPC receives on its own threads).
It never raises a process's peak: only memory the process already held is kept.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

from ..kvlog import log_event, runtime_logger

_log = runtime_logger("ps.memory")

# mallopt(3) parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD_MAX = 32 << 20
"""glibc's upper bound for M_MMAP_THRESHOLD on 64-bit: buffers below it come from the heap."""
RETAIN_BYTES = 512 << 20
"""Freed memory a PS process keeps: enough for the messages of a pull and a push of a
model of a few hundred megabytes in flight."""
TOP_PAD_BYTES = 16 << 20
ARENAS = 2
"""Python allocates under its interpreter lock, one thread at a time: more arenas only
spread the retained memory thinner. Takes effect for threads started after the call."""


class Mallopt:
    """The C library's ``mallopt`` (glibc); :attr:`available` is False where it has none."""

    def __init__(self, libc: ctypes.CDLL | None = None) -> None:
        if libc is None:
            name = ctypes.util.find_library("c")
            libc = ctypes.CDLL(name) if name else None
        self._fn = getattr(libc, "mallopt", None) if libc is not None else None

    @property
    def available(self) -> bool:
        return self._fn is not None

    def __call__(self, param: int, value: int) -> bool:
        """Set one parameter; True when the C library took it."""
        return self._fn is not None and bool(self._fn(ctypes.c_int(param), ctypes.c_int(value)))


def retain_freed_memory(retain: int = RETAIN_BYTES, mallopt: Mallopt | None = None) -> bool:
    """Keep up to ``retain`` bytes of freed memory for reuse (see the module docstring);
    True when the C library took every setting. Call it at process start, before the
    transport's threads exist."""
    mallopt = mallopt if mallopt is not None else Mallopt()
    if not mallopt.available:
        log_event(_log, logging.INFO, "malloc_untuned", reason="no mallopt in the C library")
        return False
    retain = min(retain, (1 << 31) - 1)  # mallopt takes an int
    taken = [mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX), mallopt(M_TRIM_THRESHOLD, retain),
             mallopt(M_TOP_PAD, TOP_PAD_BYTES), mallopt(M_ARENA_MAX, ARENAS)]
    if not all(taken):
        log_event(_log, logging.WARNING, "malloc_untuned", reason="mallopt refused a setting")
    return all(taken)
