"""A real S3-compatible server (MinIO, built from its Go module) for checkpoint tests.

It listens on a free loopback port, keeps its objects in a folder of its own, and takes
fixed credentials, which clients read from the standard ``AWS_*`` variables
(:meth:`S3Server.env`).
"""

from __future__ import annotations

import secrets
import subprocess
import time
from pathlib import Path
from typing import IO

import httpx

from .control_plane import free_port


class S3Server:
    """One MinIO process serving ``data_dir`` on 127.0.0.1 with its own credentials."""

    def __init__(self, binary: Path, workdir: Path) -> None:
        self.binary, self.workdir = binary, workdir
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.access_key = f"rw{secrets.token_hex(6)}"
        self.secret_key = secrets.token_hex(16)
        self.region = "us-east-1"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def log_path(self) -> Path:
        """The server's own output."""
        return self.workdir / "minio.log"

    def env(self) -> dict[str, str]:
        """The standard variables an S3 client (boto3, the AWS CLI) connects with."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_REGION": self.region,
        }

    def start(self, timeout: float = 60.0) -> None:
        """Start and wait until the server answers its readiness probe."""
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        # The console port is bound too; give it a free one so that parallel servers
        # never collide on its default.
        self._proc = subprocess.Popen(
            [str(self.binary), "server", "--quiet", "--address", f"127.0.0.1:{self.port}",
             "--console-address", f"127.0.0.1:{free_port()}", str(data)],
            env={"MINIO_ROOT_USER": self.access_key, "MINIO_ROOT_PASSWORD": self.secret_key,
                 "MINIO_REGION": self.region, "MINIO_BROWSER": "off",
                 "MINIO_UPDATE": "off", "HOME": str(self.workdir)},
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"minio exited {self._proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"{self.endpoint}/minio/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"minio not ready within {timeout:.0f}s; see {self.log_path}")

    def stop(self) -> None:
        """Stop the process."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._log is not None:
            self._log.close()
