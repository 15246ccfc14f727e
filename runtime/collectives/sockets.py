"""Abort a gloo group from another thread by shutting down its TCP connections.

Gloo has no working abort for an operation in flight (``ProcessGroupGloo.abort()``
leaves a blocked ``all_reduce`` waiting until the library timeout), and Horovod's
gloo controller has none at all. Both fail every pending and later operation at
once, with an ordinary error, when the connections between the members close. So
the runtime notes which sockets the library opened while forming the group and,
to abort, shuts them down (``shutdown(2)`` on a duplicate descriptor: the library
keeps its own descriptor, which only reads end-of-file from then on).

Linux only (``/proc/self/fd``); elsewhere :meth:`GroupSockets.abort` does nothing
and a dead peer surfaces at the collective timeout.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Collection
from pathlib import Path

_FDS = Path("/proc/self/fd")


def socket_inodes() -> dict[int, int]:
    """This process's open sockets: descriptor to socket inode."""
    out: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir(_FDS):
            try:
                target = os.readlink(_FDS / entry)
            except OSError:
                continue
            if target.startswith("socket:["):
                out[int(entry)] = int(target[len("socket:["):-1])
    return out


class GroupSockets:
    """The TCP connections a library opened while forming one group.

    Create it just before the library forms the group and call :meth:`formed` just
    after; :meth:`abort` (from any thread) shuts down the connections opened in
    between, or, while forming is still under way, every connection opened since.
    Connections to or from ``keep_ports`` (the generation's store, the readiness port)
    are never touched, so the heartbeats and probes outlive the group.
    """

    def __init__(self, keep_ports: Collection[int]) -> None:
        self._keep = set(keep_ports)
        self._before = set(socket_inodes().values())
        self._group: dict[int, int] | None = None
        self._lock = threading.Lock()

    def formed(self) -> None:
        """The library finished forming the group: its connections are the new ones."""
        with self._lock:
            self._group = self._opened_since()

    def abort(self) -> int:
        """Shut down the group's connections; the number shut down."""
        with self._lock:
            group = self._group if self._group is not None else self._opened_since()
            current = socket_inodes()
            done = 0
            for fd, inode in group.items():
                # The descriptor may have been closed and reused since: same inode only.
                if current.get(fd) == inode and self._shutdown(fd):
                    done += 1
            return done

    def _opened_since(self) -> dict[int, int]:
        return {fd: inode for fd, inode in socket_inodes().items() if inode not in self._before}

    def _shutdown(self, fd: int) -> bool:
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            return False
        try:
            if sock.type != socket.SOCK_STREAM or \
                    sock.family not in (socket.AF_INET, socket.AF_INET6):
                return False
            local, peer = sock.getsockname(), sock.getpeername()
            if local[1] in self._keep or peer[1] in self._keep:
                return False
            sock.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:
            # Not connected (a listener) or already gone.
            return False
        finally:
            sock.close()
