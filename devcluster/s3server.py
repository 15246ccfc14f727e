"""A real S3-compatible server (MinIO, built from its Go module) for checkpoint tests.

It listens on a free loopback port, keeps its objects in a folder of its own, and takes
fixed credentials, which clients read from the standard ``AWS_*`` variables
(:meth:`S3Server.env`).
"""

from __future__ import annotations

import secrets
from pathlib import Path

from .control_plane import free_port
from .local_server import LocalServer


class S3Server:
    """One MinIO process serving ``data_dir`` on 127.0.0.1 with its own credentials."""

    def __init__(self, binary: Path, workdir: Path) -> None:
        self.binary, self.workdir = binary, workdir
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.access_key = f"rw{secrets.token_hex(6)}"
        self.secret_key = secrets.token_hex(16)
        self.region = "us-east-1"
        self._server = LocalServer("minio", self.log_path)

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
        # The console port is bound too; give it a free one so that parallel servers
        # never collide on its default.
        self._server.start(
            [str(self.binary), "server", "--quiet", "--address", f"127.0.0.1:{self.port}",
             "--console-address", f"127.0.0.1:{free_port()}", str(data)],
            f"{self.endpoint}/minio/health/ready", timeout,
            env={"MINIO_ROOT_USER": self.access_key, "MINIO_ROOT_PASSWORD": self.secret_key,
                 "MINIO_REGION": self.region, "MINIO_BROWSER": "off",
                 "MINIO_UPDATE": "off", "HOME": str(self.workdir)})

    def stop(self) -> None:
        """Stop the process."""
        self._server.stop()
