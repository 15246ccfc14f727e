"""What ``/proc`` says about a process, for telling a live process from a reused pid."""

from __future__ import annotations


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot); None when there is none.
    A pid with another start time is another process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
