"""Buckets on the test S3 server (the ``s3_server`` and ``s3_bucket`` fixtures)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from ringwright.devcluster.s3server import S3Server


@dataclass(frozen=True)
class S3Bucket:
    """A bucket made for one test, and a client that reaches it."""

    name: str
    client: Any
    server: S3Server

    def url(self, prefix: str = "checkpoints") -> str:
        """``s3://<bucket>/<prefix>``: a job's spec.checkpoint.path."""
        return f"s3://{self.name}/{prefix}"

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key under ``prefix``, sorted."""
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name,
                                                                      Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", ()))

    def uploads(self, key: str) -> list[str]:
        """Ids of the unfinished multipart uploads of ``key``."""
        found = self.client.list_multipart_uploads(Bucket=self.name, Prefix=key)
        return [u["UploadId"] for u in found.get("Uploads", ()) if u["Key"] == key]


def server_client(server: S3Server) -> Any:
    """A client of ``server`` that takes nothing from the environment."""
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3", endpoint_url=server.endpoint, region_name=server.region,
        aws_access_key_id=server.access_key, aws_secret_access_key=server.secret_key,
        config=Config(s3={"addressing_style": "path"}))


def new_bucket(server: S3Server) -> S3Bucket:
    """Create a bucket with a random name."""
    client = server_client(server)
    name = f"ckpt-{secrets.token_hex(6)}"
    client.create_bucket(Bucket=name)
    return S3Bucket(name, client, server)
