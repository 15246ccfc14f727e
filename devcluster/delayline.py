"""A user-space delay line: a link that holds every frame for a fixed time.

Where the kernel has no ``sch_netem``, :mod:`ringwright.devcluster.netemu` replaces a
delayed veth pair by two TAP devices, one in each namespace, and this relay between
them. Every frame read from one device is written to the other once the configured
one-way delay has passed, in the order it came (a FIFO of deadlines). TAP devices
carry Ethernet frames, so the two ends stay bridge ports and nothing else in the
network changes; rate limits stay ``tc tbf`` qdiscs on the devices.

:class:`DelayLine` is the pure queue (the clock is passed in);
:func:`relay` is the loop that moves frames.

    python -m ringwright.devcluster.delayline DELAY_MS NAMESPACE DEVICE NAMESPACE DEVICE

opens the persistent TAP ``DEVICE`` in each named network namespace (``ip tuntap add``
made them), stays on one CPU (so frames it writes keep their order), prints ``ready``
and relays until it is killed, or its parent exits.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import select
import signal
import struct
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence

_TUNSETIFF = 0x400454CA
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_FRAME_MAX = 65536 + 64
"""Largest frame a read can return: the largest MTU plus the Ethernet header."""
_BATCH = 64
"""Frames read from one device before due frames are written again."""


class DelayLine:
    """Frames in arrival order, each released ``delay_s`` after it arrived.

    Frames leave from the head only, so none leaves before one that arrived
    earlier, even if the clock steps back.
    """

    def __init__(self, delay_s: float) -> None:
        if delay_s < 0:
            raise ValueError(f"a delay cannot be negative: {delay_s}")
        self.delay_s = delay_s
        self._queue: deque[tuple[float, bytes]] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, frame: bytes, now: float) -> None:
        """Take ``frame``, arrived at ``now``."""
        self._queue.append((now + self.delay_s, frame))

    def next_deadline(self) -> float | None:
        """When the oldest frame is due; None when empty."""
        return self._queue[0][0] if self._queue else None

    def pop_due(self, now: float) -> list[bytes]:
        """The frames due at ``now``, oldest first, removed from the line."""
        due = []
        while self._queue and self._queue[0][0] <= now:
            due.append(self._queue.popleft()[1])
        return due


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def enter_namespace(path: str) -> None:
    """Move this (single-threaded) process into the network namespace at ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        _check(_libc().setns(fd, _CLONE_NEWNET), f"setns {path}")
    finally:
        os.close(fd)


def open_tap(device: str) -> int:
    """A non-blocking file descriptor attached to the TAP ``device`` of this
    process's network namespace (the namespace is fixed when the fd is opened)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", device.encode(),
                                                _IFF_TAP | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def _read_into(fd: int, line: DelayLine, now: float) -> None:
    for _ in range(_BATCH):
        try:
            frame = os.read(fd, _FRAME_MAX)
        except BlockingIOError:
            return
        line.push(frame, now)


def relay(a: int, b: int, delay_s: float,
          clock: Callable[[], float] = time.monotonic) -> None:
    """Forward frames between the devices ``a`` and ``b`` both ways, each ``delay_s``
    late; runs until the process ends."""
    lines = {a: (DelayLine(delay_s), b), b: (DelayLine(delay_s), a)}
    while True:
        deadlines = [d for line, _ in lines.values() if (d := line.next_deadline()) is not None]
        timeout = max(0.0, min(deadlines) - clock()) if deadlines else None
        readable, _, _ = select.select([a, b], [], [], timeout)
        now = clock()
        for fd in readable:
            _read_into(fd, lines[fd][0], now)
        for line, out in lines.values():
            for frame in line.pop_due(now):
                os.write(out, frame)


def main(argv: Sequence[str]) -> int:
    """``DELAY_MS NAMESPACE DEVICE NAMESPACE DEVICE``: relay between the two TAPs."""
    if len(argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    # Die with the network's owner, so a killed run leaves no relay holding a namespace.
    _check(_libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL), "prctl")
    if os.getppid() == 1:
        return 1
    home = f"/proc/{os.getpid()}/ns/net"
    home_fd = os.open(home, os.O_RDONLY)
    fds = []
    try:
        for ns, dev in ((argv[1], argv[2]), (argv[3], argv[4])):
            enter_namespace(f"/run/netns/{ns}")
            fds.append(open_tap(dev))
    finally:
        # Back home, where `ip netns pids` finds the relay when its network is removed.
        _check(_libc().setns(home_fd, _CLONE_NEWNET), "setns back")
        os.close(home_fd)
    # A TAP write queues the frame on the writing CPU's backlog; a relay that moved
    # between CPUs could let a later frame overtake an earlier one. A link keeps order.
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    print("ready", flush=True)
    relay(fds[0], fds[1], float(argv[0]) / 1000)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
