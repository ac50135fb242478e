"""An S3-compatible object store: ``s3://bucket/prefix``.

The endpoint comes from ``DELTASYNC_S3_ENDPOINT`` or ``AWS_ENDPOINT_URL`` (AWS
itself when neither is set); credentials come only from boto3's usual sources
(environment, shared files, instance roles) and are never logged. Addressing is
path-style so that any S3-compatible server works without DNS tricks. A PUT in
S3 is atomic, so readers never see a partial object; large files go up as
multipart uploads, which also become visible only once complete.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import boto3
import botocore.session
import structlog
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    ReadTimeoutError,
)

from pipeline.config import S3_DEFAULT_MAX_ATTEMPTS, S3_DEFAULT_PART_SIZE, s3_tuning
from pipeline.errors import ConfigError, ObjectNotFoundError, StoreError
from pipeline.store.base import BucketKeys, check_prefix, check_range, download_to

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

log = structlog.get_logger(__name__)

DEFAULT_PART_SIZE = S3_DEFAULT_PART_SIZE
_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
_BOTO_ERRORS: tuple[type[Exception], ...] = (BotoCoreError, ClientError, S3UploadFailedError)
_UNREACHABLE = (
    EndpointConnectionError,
    ConnectionClosedError,
    ConnectTimeoutError,
    ReadTimeoutError,
)


_LOADER_LOCK = threading.Lock()
_LOADER: Any = None


def _new_session() -> boto3.session.Session:
    """A fresh boto3 session (own credentials) sharing one parsed-service-model loader.

    Parsing botocore's JSON models is most of the cost of a client; sharing the
    loader makes opening a store cheap without sharing credential state.
    """
    global _LOADER  # a process-wide cache of immutable model data
    core = botocore.session.get_session()
    with _LOADER_LOCK:
        if _LOADER is None:
            _LOADER = core.get_component("data_loader")
        else:
            core.register_component("data_loader", _LOADER)
    return boto3.session.Session(botocore_session=core)


class S3Store(BucketKeys):
    """Objects under ``prefix`` in one S3 bucket."""

    _failures = _BOTO_ERRORS

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint: str | None = None,
        region: str | None = None,
        part_size: int = DEFAULT_PART_SIZE,
        max_attempts: int = S3_DEFAULT_MAX_ATTEMPTS,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
    ) -> None:
        if not bucket:
            raise ConfigError("S3 store URL needs a bucket: s3://bucket/prefix")
        if part_size < 5 << 20:
            raise ConfigError(f"S3 multipart part size must be at least 5 MiB, got {part_size}")
        self.bucket = bucket
        self.prefix = check_prefix(prefix) if prefix else ""
        self.endpoint = endpoint or None
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._config = Config(
            s3={"addressing_style": "path"},
            retries={"mode": "standard", "max_attempts": max_attempts},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
        )
        env_region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        self.region = region or env_region or "us-east-1"
        self._client_lock = threading.Lock()
        self._client_pid = 0
        self._s3: S3Client | None = None
        self._transfer = TransferConfig(
            multipart_threshold=part_size, multipart_chunksize=part_size, use_threads=True
        )

    @classmethod
    def from_url(cls, url: str) -> S3Store:
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise ConfigError(f"not an S3 store URL (s3://bucket/prefix): {url!r}")
        if parts.query or parts.fragment:
            raise ConfigError(f"S3 store URL takes no query or fragment: {url!r}")
        tuning = s3_tuning()
        return cls(
            parts.netloc,
            parts.path.strip("/"),
            endpoint=tuning.endpoint,
            part_size=tuning.part_size,
            max_attempts=tuning.max_attempts,
        )

    def __repr__(self) -> str:
        return f"S3Store({self.url!r}, endpoint={self._where!r})"

    @property
    def _client(self) -> S3Client:
        # A forked child must not share its parent's connection pool: make its own.
        client, pid = self._s3, os.getpid()
        if client is not None and self._client_pid == pid:
            return client
        if self._client_pid != pid:
            self._client_lock = threading.Lock()  # the parent's may have been held at fork
        with self._client_lock:
            if self._s3 is None or self._client_pid != os.getpid():
                self._s3 = _new_session().client(
                    "s3", endpoint_url=self.endpoint, region_name=self.region, config=self._config
                )
                self._client_pid = os.getpid()
            return self._s3

    @property
    def _where(self) -> str:
        return self.endpoint or "AWS"

    def _error(self, action: str, key: str, error: Exception) -> StoreError:
        """Translate a botocore error into one line naming the key and the endpoint."""
        where = f"{self.url} at {self._where}"
        if isinstance(error, S3UploadFailedError):
            inner = error.__cause__ or error.__context__  # the transfer manager wraps it
            if isinstance(inner, Exception):
                error = inner
        if isinstance(error, ClientError):
            info: dict[str, Any] = dict(error.response.get("Error", {}))
            code = str(info.get("Code", ""))
            if code in _NOT_FOUND_CODES:
                return ObjectNotFoundError(f"object {key!r} not found in {where}")
            if code == "NoSuchBucket":
                return StoreError(f"bucket {self.bucket!r} does not exist at {self._where}")
            message = str(info.get("Message") or "").splitlines()[0:1]
            detail = f"{code} {message[0]}" if message else code
            return StoreError(f"cannot {action} {key!r} in {where}: {detail}")
        if isinstance(error, _UNREACHABLE):
            return StoreError(
                f"cannot reach S3 at {self._where}: {type(error).__name__} while trying to "
                f"{action} {key!r}"
            )
        text = str(error).splitlines()[0] if str(error) else type(error).__name__
        return StoreError(f"cannot {action} {key!r} in {where}: {text}")

    def put(self, key: str, data: bytes) -> None:
        name = self._key(key)
        body = bytes(data)
        with self._failing("write", key):
            if len(body) > self._transfer.multipart_threshold:
                self._client.upload_fileobj(
                    io.BytesIO(body), self.bucket, name, Config=self._transfer
                )
            else:
                self._client.put_object(Bucket=self.bucket, Key=name, Body=body)

    def put_new(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if it does not exist (a conditional PUT, atomic on the
        server); return False, writing nothing, when it already exists."""
        name = self._key(key)
        try:
            self._client.put_object(Bucket=self.bucket, Key=name, Body=bytes(data), IfNoneMatch="*")
        except ClientError as error:
            status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = str(error.response.get("Error", {}).get("Code", ""))
            if status == 412 or code == "PreconditionFailed":
                return False
            raise self._error("write", key, error) from error
        except _BOTO_ERRORS as error:
            raise self._error("write", key, error) from error
        return True

    def put_file(self, key: str, path: Path) -> None:
        name = self._key(key)
        if not Path(path).is_file():
            raise StoreError(f"cannot read local file {str(path)!r}: not a file")
        with self._failing("write", key):
            self._client.upload_file(str(path), self.bucket, name, Config=self._transfer)

    def get(self, key: str) -> bytes:
        name = self._key(key)
        with self._failing("read", key):
            response = self._client.get_object(Bucket=self.bucket, Key=name)
            return response["Body"].read()

    def get_bounded(self, key: str, limit: int) -> bytes:
        """At most ``limit + 1`` bytes of the object (one ranged GET)."""
        name = self._key(key)
        try:
            response = self._client.get_object(
                Bucket=self.bucket, Key=name, Range=f"bytes=0-{limit}"
            )
            return response["Body"].read(limit + 1)
        except _BOTO_ERRORS as error:
            if _is_invalid_range(error):
                return b""  # an existing, empty object
            raise self._error("read", key, error) from error

    def get_range(self, key: str, start: int, length: int) -> bytes:
        check_range(key, start, length)
        name = self._key(key)
        if length == 0:
            self.size(key)  # still an error when the object is missing
            return b""
        try:
            response = self._client.get_object(
                Bucket=self.bucket, Key=name, Range=f"bytes={start}-{start + length - 1}"
            )
            return response["Body"].read()
        except _BOTO_ERRORS as error:
            if _is_invalid_range(error):
                return b""  # the range starts past the end of an existing object
            raise self._error("read", key, error) from error

    def get_file(self, key: str, path: Path) -> None:
        name = self._key(key)
        with self._failing("read", key), download_to(Path(path)) as temp:
            self._client.download_file(self.bucket, name, str(temp), Config=self._transfer)

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except ObjectNotFoundError:
            return False
        return True

    def size(self, key: str) -> int:
        name = self._key(key)
        with self._failing("stat", key):
            response = self._client.head_object(Bucket=self.bucket, Key=name)
        return int(response["ContentLength"])

    def list(self, prefix: str) -> Iterator[str]:
        search = self._search(prefix)
        names: list[str] = []
        with self._failing("list", prefix or "/"):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=search
            )
            for page in pages:
                names.extend(item["Key"] for item in page.get("Contents", []))
        return self._relative(names, search)

    def delete(self, key: str) -> None:
        name = self._key(key)
        try:
            self._client.delete_object(Bucket=self.bucket, Key=name)
        except _BOTO_ERRORS as error:
            converted = self._error("delete", key, error)
            if not isinstance(converted, ObjectNotFoundError):
                raise converted from error

    def ensure_bucket(self) -> None:
        """Create the bucket if it does not exist (for tests and first-time setup)."""
        try:
            self._client.head_bucket(Bucket=self.bucket)
            return
        except _BOTO_ERRORS as error:
            converted = self._error("find bucket", self.bucket, error)
            if not isinstance(converted, ObjectNotFoundError):
                raise converted from error
        with self._failing("create bucket", self.bucket):
            self._client.create_bucket(Bucket=self.bucket)
        log.info("s3 bucket created", bucket=self.bucket, endpoint=self._where)


def _is_invalid_range(error: Exception) -> bool:
    if not isinstance(error, ClientError):
        return False
    code = str(error.response.get("Error", {}).get("Code", ""))
    status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code == "InvalidRange" or status == 416
