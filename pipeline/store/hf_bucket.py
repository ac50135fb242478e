"""A Hugging Face Hub bucket as an object store: ``hf://buckets/<namespace>/<bucket>/<prefix>``.

Metadata goes through ``huggingface_hub.HfApi``'s bucket API (batch_bucket_files,
get_bucket_paths_info, list_bucket_tree, download_bucket_files); bytes move
through Xet storage. A file becomes visible only when the batch call that names
it succeeds, after its upload finished, so readers never see a partial object.
Byte ranges are read with ``hf_xet``'s ranged download streams, authorised by
the bucket's Xet read-token route, so a range read fetches only what it needs.

The endpoint is ``HF_ENDPOINT`` (read when the store is opened) or the Hub;
the token comes only from ``HF_TOKEN`` or the usual Hugging Face config.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hf_xet
import httpx2
import structlog
from huggingface_hub import HfApi
from huggingface_hub.errors import (
    BucketBatchError,
    BucketNotFoundError,
    EntryNotFoundError,
    HfHubHTTPError,
)
from huggingface_hub.utils._headers import build_hf_headers

from pipeline.errors import ConfigError, CorruptObjectError, ObjectNotFoundError, StoreError
from pipeline.store.base import BucketKeys, check_prefix, check_range, download_to, first_line

if TYPE_CHECKING:
    from huggingface_hub._buckets import BucketFile

log = structlog.get_logger(__name__)

_URL_HEAD = "hf://buckets/"


class HfBucketStore(BucketKeys):
    """Objects under ``prefix`` in one Hub bucket."""

    def __init__(
        self,
        bucket_id: str,
        prefix: str = "",
        *,
        endpoint: str | None = None,
        token: str | None = None,
    ) -> None:
        parts = bucket_id.split("/")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"HF bucket id must be <namespace>/<bucket>, got {bucket_id!r}")
        self.bucket_id = bucket_id
        self.prefix = check_prefix(prefix) if prefix else ""
        self.api: HfApi = HfApi(endpoint=endpoint, token=token)
        self.endpoint: str = self.api.endpoint
        self.url = _URL_HEAD + bucket_id + (f"/{self.prefix}" if self.prefix else "")
        self._xet_lock = threading.Lock()
        self._xet_session: Any = None
        self._xet_pid = 0

    @classmethod
    def from_url(cls, url: str) -> HfBucketStore:
        if not url.startswith(_URL_HEAD):
            raise ConfigError(
                f"not an HF bucket URL (hf://buckets/<namespace>/<bucket>/...): {url!r}"
            )
        parts = url[len(_URL_HEAD) :].strip("/").split("/", 2)
        if len(parts) < 2 or not parts[0] or not parts[1]:
            raise ConfigError(f"HF bucket URL needs a namespace and a bucket name: {url!r}")
        prefix = parts[2] if len(parts) == 3 else ""
        endpoint = os.environ.get("HF_ENDPOINT") or None
        return cls(f"{parts[0]}/{parts[1]}", prefix, endpoint=endpoint)

    def __repr__(self) -> str:
        return f"HfBucketStore({self.url!r}, endpoint={self.endpoint!r})"

    def _error(self, action: str, key: str, error: Exception) -> StoreError:
        """One line naming the key, the bucket and the endpoint; never the token."""
        where = f"{self.url} at {self.endpoint}"
        if isinstance(error, EntryNotFoundError):
            return ObjectNotFoundError(f"object {key!r} not found in {where}")
        if isinstance(error, BucketNotFoundError):
            return StoreError(
                f"bucket {self.bucket_id!r} not found (or no access) at {self.endpoint}"
            )
        if isinstance(error, httpx2.TransportError):
            return StoreError(f"cannot reach the Hub at {self.endpoint}: {type(error).__name__}")
        if isinstance(error, HfHubHTTPError):
            status = error.response.status_code if error.response is not None else "?"
            line = first_line(error)
            return StoreError(f"cannot {action} {key!r} in {where}: HTTP {status} {line}")
        return StoreError(
            f"cannot {action} {key!r} in {where}: {type(error).__name__} {first_line(error)}"
        )

    # -- writes ----------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        name = self._key(key)
        with self._failing("write", key):
            self.api.batch_bucket_files(self.bucket_id, add=[(bytes(data), name)])

    def put_file(self, key: str, path: Path) -> None:
        name = self._key(key)
        if not Path(path).is_file():
            raise StoreError(f"cannot read local file {str(path)!r}: not a file")
        with self._failing("write", key):
            self.api.batch_bucket_files(self.bucket_id, add=[(str(path), name)])

    def delete(self, key: str) -> None:
        name = self._key(key)
        try:
            self.api.batch_bucket_files(self.bucket_id, delete=[name])
        except BucketBatchError as error:
            if self._info(key) is not None:  # only a still-present object is a failure
                raise self._error("delete", key, error) from error
        except Exception as error:
            raise self._error("delete", key, error) from error

    def ensure_bucket(self, private: bool = True) -> None:
        """Create the bucket if it does not exist (first-time setup and tests)."""
        with self._failing("create bucket", self.bucket_id):
            self.api.create_bucket(self.bucket_id, private=private, exist_ok=True)
        log.info("hf bucket ready", bucket=self.bucket_id, endpoint=self.endpoint)

    # -- reads -----------------------------------------------------------------------

    def _info(self, key: str) -> BucketFile | None:
        name = self._key(key)
        with self._failing("stat", key):
            for info in self.api.get_bucket_paths_info(self.bucket_id, [name]):
                if info.path == name:
                    return info
        return None

    def _require(self, key: str) -> BucketFile:
        info = self._info(key)
        if info is None:
            raise ObjectNotFoundError(f"object {key!r} not found in {self.url} at {self.endpoint}")
        return info

    def exists(self, key: str) -> bool:
        return self._info(key) is not None

    def size(self, key: str) -> int:
        return int(self._require(key).size)

    def get(self, key: str) -> bytes:
        info = self._require(key)
        return self._read(key, info, 0, int(info.size))

    def get_bounded(self, key: str, limit: int) -> bytes:
        """The object when its listed size is at most ``limit``; nothing is downloaded
        otherwise."""
        info = self._require(key)
        if int(info.size) > limit:
            raise CorruptObjectError(
                f"object {key} is {info.size} bytes, more than {limit} expected"
            )
        return self._read(key, info, 0, int(info.size))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        check_range(key, start, length)
        info = self._require(key)
        return self._read(key, info, start, min(start + length, int(info.size)))

    def _read(self, key: str, info: BucketFile, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        with self._failing("read", key):
            group = self._session().new_download_stream_group(
                token_refresh_url=self._xet_refresh_url("read"),
                token_refresh_headers=self._headers(),
            )
            file_info = hf_xet.XetFileInfo(info.xet_hash, int(info.size))
            data = b"".join(group.download_stream(file_info, start=start, end=end))
        if len(data) != end - start:
            raise StoreError(
                f"short read of {key!r} in {self.url}: {len(data)} of {end - start} bytes"
            )
        return data

    def get_file(self, key: str, path: Path) -> None:
        name = self._key(key)
        try:
            with download_to(Path(path)) as temp:
                self.api.download_bucket_files(
                    self.bucket_id, [(name, temp)], raise_on_missing_files=True
                )
        except EntryNotFoundError as error:
            raise ObjectNotFoundError(
                f"object {key!r} not found in {self.url} at {self.endpoint}"
            ) from error
        except OSError as error:
            raise StoreError(
                f"cannot write {key!r} from {self.url} to {str(path)!r}: {error.strerror}"
            ) from error
        except Exception as error:
            raise self._error("read", key, error) from error

    def list(self, prefix: str) -> Iterator[str]:
        search = self._search(prefix)
        with self._failing("list", prefix or "/"):
            entries = self.api.list_bucket_tree(
                self.bucket_id, prefix=search or None, recursive=True
            )
            names = [entry.path for entry in entries if entry.type == "file"]
        return self._relative(names, search)

    # -- Xet plumbing ------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        return dict(build_hf_headers(token=self.api.token, library_name="deltasync"))

    def _xet_refresh_url(self, mode: str) -> str:
        # The Hub's route that hands out short-lived Xet tokens and the CAS URL.
        return f"{self.endpoint}/api/buckets/{self.bucket_id}/xet-{mode}-token"

    def _session(self) -> Any:
        # One hf_xet session per process: a forked child must not reuse its parent's.
        with self._xet_lock:
            if self._xet_session is None or self._xet_pid != os.getpid():
                self._xet_session = hf_xet.XetSession()
                self._xet_pid = os.getpid()
            return self._xet_session
