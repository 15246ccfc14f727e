"""Checkpoint storage in an S3-compatible bucket: ``spec.checkpoint.path: s3://bucket/prefix``.

An S3 object appears whole when its upload completes and never before, so a staged file
writes to its final key directly: small files go up in one PUT on commit, larger ones as a
multipart upload whose completion is the commit. Readers therefore never see a partial
object, and a replaced object flips from old to new content at once.

An interrupted multipart upload is invisible to listings, yet its parts cost storage. So
a writer that starts one also leaves a small marker object ``<name>.partial-<random>``
holding the upload's id: the checkpointer sees it in :meth:`S3Storage.listdir` like a
local partial file, and :meth:`S3Storage.delete` of the marker aborts the upload too.

Endpoint, region and credentials come from the standard variables (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL``, ``AWS_REGION`` or ``AWS_DEFAULT_REGION``), which the operator fills
from the job's ``spec.checkpoint.credentialsSecret`` and ``spec.checkpoint.endpoint``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from types import TracebackType
from typing import Any, Self

from .storage import PARTIAL_MARKER, Bytes, ReadStream, StagedFile, check_name

SCHEME = "s3://"

PART_SIZE = 8 * 1024 * 1024
"""Bytes per uploaded part; a file smaller than this goes up in a single PUT on commit.
S3 refuses parts under 5 MiB (but the last one)."""

MIN_PART_SIZE = 5 * 1024 * 1024

_MISSING = {"404", "NoSuchKey", "NotFound"}


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix/")`` (prefix may be empty)."""
    if not url.startswith(SCHEME):
        raise ValueError(f"checkpoint path {url!r} is not an s3:// URL")
    bucket, _, prefix = url[len(SCHEME) :].partition("/")
    if not bucket:
        raise ValueError(
            f"checkpoint path {url!r} names no bucket: write s3://<bucket>/<prefix>"
        )
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


def client_from_env() -> Any:
    """An S3 client configured from the standard AWS variables (see the module's doc)."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:
        raise ImportError(
            "checkpoints at an s3:// path need boto3: install ringwright[runtime] "
            "(the training image has it)"
        ) from exc

    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    config = Config(
        retries={"mode": "standard", "max_attempts": 5},
        # Self-hosted servers (MinIO, Ceph, ...) behind one host name or an IP address
        # serve buckets as paths, not as subdomains.
        s3={"addressing_style": "path" if endpoint else "auto"},
    )
    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint or None, region_name=region or "us-east-1", config=config
    )


def _error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


@contextlib.contextmanager
def _as_os_errors(where: str) -> Iterator[None]:
    """Turn the client's errors into the OSErrors the checkpointer handles."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except ClientError as exc:
        if _error_code(exc) in _MISSING:
            raise FileNotFoundError(f"{where} does not exist") from exc
        raise OSError(f"{where}: {exc}") from exc
    except BotoCoreError as exc:
        raise OSError(f"{where}: {exc}") from exc


class _S3Read:
    """An object's body, streamed (never loaded whole)."""

    def __init__(self, body: Any, where: str) -> None:
        self._body = body
        self._where = where

    def read(self, size: int = -1, /) -> bytes:
        with _as_os_errors(self._where):
            data: bytes = self._body.read(None if size < 0 else size)
        return data

    def readinto(self, buffer: memoryview, /) -> int:
        target = memoryview(buffer).cast("B")
        filled = 0
        while filled < len(target):
            chunk = self.read(min(len(target) - filled, PART_SIZE))
            if not chunk:
                break
            target[filled : filled + len(chunk)] = chunk
            filled += len(chunk)
        return filled

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
        /,
    ) -> None:
        self._body.close()


class _S3StagedFile:
    """Bytes bound for one key: a PUT on commit, or a multipart upload completed on commit."""

    def __init__(self, storage: S3Storage, name: str) -> None:
        self._storage = storage
        self._name = name
        self._key = storage.key(name)
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._marker = ""
        self._parts: list[dict[str, Any]] = []
        self._state = "open"

    def _check_open(self, action: str) -> None:
        if self._state != "open":
            where = self._storage.describe(self._name)
            raise ValueError(f"{action} of {where} after commit or abort")

    def write(self, data: Bytes) -> None:
        self._check_open("write")
        view = memoryview(data).cast("B")
        size = self._storage.part_size
        while view:
            room = size - len(self._buffer)
            self._buffer += view[:room]
            view = view[room:]
            if len(self._buffer) >= size:
                self._upload_part()

    def _upload_part(self) -> None:
        client, bucket = self._storage.client, self._storage.bucket
        where = self._storage.describe(self._name)
        with _as_os_errors(where):
            if self._upload_id is None:
                started = client.create_multipart_upload(Bucket=bucket, Key=self._key)
                self._upload_id = str(started["UploadId"])
                # The marker makes an upload its writer never finishes visible to listdir.
                self._marker = f"{self._name}{PARTIAL_MARKER}{secrets.token_hex(4)}"
                client.put_object(Bucket=bucket, Key=self._storage.key(self._marker),
                                  Body=self._upload_id.encode())
            number = len(self._parts) + 1
            part = client.upload_part(Bucket=bucket, Key=self._key, UploadId=self._upload_id,
                                      PartNumber=number, Body=bytes(self._buffer))
        self._parts.append({"ETag": part["ETag"], "PartNumber": number})
        self._buffer.clear()

    def commit(self) -> None:
        self._check_open("commit")
        client, bucket = self._storage.client, self._storage.bucket
        try:
            with _as_os_errors(self._storage.describe(self._name)):
                if self._upload_id is None:
                    client.put_object(Bucket=bucket, Key=self._key, Body=bytes(self._buffer))
                else:
                    if self._buffer:
                        self._upload_part()
                    client.complete_multipart_upload(
                        Bucket=bucket, Key=self._key, UploadId=self._upload_id,
                        MultipartUpload={"Parts": self._parts},
                    )
                    self._upload_id = None
        except BaseException:
            with contextlib.suppress(OSError):  # the commit's own error is the one to see
                self.abort()
            raise
        self._state = "committed"
        self._buffer = bytearray()
        if self._marker:
            # The file is committed either way; a marker left behind names a finished
            # upload, and the checkpointer's next prune removes it.
            with contextlib.suppress(OSError):
                self._storage.delete(self._marker)

    def abort(self) -> None:
        if self._state != "open":
            return
        self._state = "aborted"
        self._buffer = bytearray()
        if self._upload_id is not None:
            self._storage.abort_upload(self._key, self._upload_id)
        if self._marker:
            self._storage.delete(self._marker)


class S3Storage:
    """Checkpoint storage under ``s3://bucket/prefix``: names become keys below the prefix."""

    def __init__(self, url: str, client: Any | None = None, part_size: int = PART_SIZE) -> None:
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"S3 parts must be at least {MIN_PART_SIZE} bytes, not {part_size}")
        self.bucket, self.prefix = parse_url(url)
        self.client = client if client is not None else client_from_env()
        self.part_size = part_size

    def key(self, name: str) -> str:
        """The object key of ``name``."""
        check_name(name)
        return f"{self.prefix}{name}"

    def create(self, name: str) -> StagedFile:
        """Start a staged write of ``name`` (see :class:`StagedFile`)."""
        return _S3StagedFile(self, name)

    def open_read(self, name: str) -> ReadStream:
        """Stream ``name``'s object."""
        where = self.describe(name)
        with _as_os_errors(where):
            response = self.client.get_object(Bucket=self.bucket, Key=self.key(name))
        return _S3Read(response["Body"], where)

    def size(self, name: str) -> int:
        """Size of ``name``'s object in bytes."""
        with _as_os_errors(self.describe(name)):
            head = self.client.head_object(Bucket=self.bucket, Key=self.key(name))
        return int(head["ContentLength"])

    def listdir(self, folder: str) -> list[str]:
        """Objects directly under ``folder``, sorted (markers of unfinished uploads too)."""
        prefix = f"{self.key(folder.rstrip('/'))}/"
        names: list[str] = []
        with _as_os_errors(self.describe(folder)):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix, Delimiter="/"
            )
            for page in pages:
                names.extend(item["Key"][len(self.prefix) :] for item in page.get("Contents", ()))
        return sorted(names)

    def delete(self, name: str) -> None:
        """Remove ``name``; for an upload's marker, abort the upload it names first."""
        key = self.key(name)
        folder, _, base = name.rpartition("/")
        target, marker, _ = base.partition(PARTIAL_MARKER)
        if marker:
            upload_id = ""
            with contextlib.suppress(FileNotFoundError), self.open_read(name) as stream:
                upload_id = stream.read().decode()
            if upload_id:
                self.abort_upload(self.key(f"{folder}/{target}" if folder else target),
                                  upload_id)
        with _as_os_errors(self.describe(name)):
            # S3 deletes are idempotent: an absent key is not an error.
            self.client.delete_object(Bucket=self.bucket, Key=key)

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Drop an unfinished multipart upload's parts; one already gone is not an error."""
        from botocore.exceptions import ClientError

        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        except ClientError as exc:
            if _error_code(exc) not in {"NoSuchUpload", *_MISSING}:
                raise OSError(f"aborting the upload of s3://{self.bucket}/{key}: {exc}") from exc

    def describe(self, name: str) -> str:
        """The ``s3://`` URL of ``name``."""
        return f"{SCHEME}{self.bucket}/{self.prefix}{name}"
