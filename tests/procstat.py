"""What /proc says about a process: its state, its CPU time and its peak resident memory."""

from __future__ import annotations

import os
from pathlib import Path


def process_state(pid: int) -> str | None:
    """Process ``pid``'s state letter (``Z``: ended, not yet reaped); None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def cpu_seconds(pid: int) -> float:
    """The process's user + system CPU time so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set size so far (VmHWM). The figure goes with the
    process's memory: once it has exited (reaped or not) this raises ProcessLookupError."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError as exc:
        raise ProcessLookupError(f"no process {pid}") from exc
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise ProcessLookupError(f"process {pid} has exited (no VmHWM)")
