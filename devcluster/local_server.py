"""A server process of the local cluster's tests (Prometheus, MinIO): started with its
output in a log file, waited for on its readiness URL, stopped gently then firmly."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

import httpx


class LocalServer:
    """One process named ``name``, logging to ``log_path``."""

    def __init__(self, name: str, log_path: Path) -> None:
        self.name, self.log_path = name, log_path
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self, argv: Sequence[str], ready_url: str, timeout: float,
              env: Mapping[str, str] | None = None) -> None:
        """Start ``argv`` and wait until ``ready_url`` answers 200; an exit or no answer
        within ``timeout`` seconds raises, naming the log."""
        self._log = self.log_path.open("ab")
        self._proc = subprocess.Popen(
            list(argv), env=None if env is None else dict(env),
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self._proc.returncode}; "
                                   f"see {self.log_path}")
            try:
                if httpx.get(ready_url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready within {timeout:.0f}s; see {self.log_path}")

    def stop(self) -> None:
        """Stop the process: SIGTERM, then SIGKILL after 15 s."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._log is not None:
            self._log.close()
