"""Finding the processes of a pod's local ranks, as the pod entry point started them."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

_STARTED = re.compile(r"local_rank_started local_rank=(\d+) pid=(\d+)")


def _children(pid: int) -> list[int]:
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


def pod_ranks(entry: int, log: Path) -> dict[int, int]:
    """The pids of the local ranks the pod entry point ``entry`` runs, by local rank.

    The ranks are the entry point's children, or with forked ranks its fork server's
    children; which rank each is comes from the entry point's own log lines
    (``local_rank_started``), since a forked rank's ``/proc/<pid>/environ`` still shows
    the server's environment."""
    rank_of = {int(m[2]): int(m[1]) for m in _STARTED.finditer(log.read_text(errors="replace"))}
    out = {}
    for child in _children(entry):
        for pid in (child, *_children(child)):
            if pid in rank_of:
                out[rank_of[pid]] = pid
    return out
