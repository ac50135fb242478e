"""The object store interface every backend implements.

Keys are relative to the store's root (the prefix in its URL), use ``/`` as
separator, and are checked by :func:`check_key` so that no backend ever
writes outside its root.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

from pipeline.errors import ConfigError, CorruptObjectError, StoreError

_KEY_PART = re.compile(r"^[A-Za-z0-9._=+-][A-Za-z0-9._=+-]*$")


def check_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key, else raise ConfigError."""
    if not key or len(key) > 1024 or key.startswith("/") or key.endswith("/"):
        raise ConfigError(f"invalid object key {key!r}")
    for part in key.split("/"):
        if part in (".", "..") or not _KEY_PART.match(part):
            raise ConfigError(f"invalid object key {key!r}")
    return key


@runtime_checkable
class ObjectStore(Protocol):
    """Write-once object storage. Readers never see a partial object."""

    url: str

    def put(self, key: str, data: bytes) -> None:
        """Write an object atomically (replaces an existing one)."""

    def put_file(self, key: str, path: Path) -> None:
        """Upload a local file atomically, streaming it."""

    def get(self, key: str) -> bytes:
        """Read a whole object; ObjectNotFoundError if absent."""

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Read ``length`` bytes from ``start`` (fewer at the end of the object)."""

    def get_file(self, key: str, path: Path) -> None:
        """Download an object to a local file, atomically, streaming it."""

    def exists(self, key: str) -> bool: ...

    def size(self, key: str) -> int:
        """Object size in bytes; ObjectNotFoundError if absent."""

    def list(self, prefix: str) -> Iterator[str]:
        """Keys under ``prefix`` (a folder-like prefix, with or without trailing /), sorted."""

    def delete(self, key: str) -> None:
        """Delete an object; deleting a missing key is not an error."""


def is_valid_key(key: str) -> bool:
    """Whether ``key`` is one deltasync could have written: listings skip the others
    (foreign objects such as ``a//b``, temporary files)."""
    try:
        check_key(key)
    except ConfigError:
        return False
    return True


def first_line(error: BaseException) -> str:
    """The first line of an error's text ("" when it has none): messages stay one line."""
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def temp_sibling(target: Path) -> Path:
    """A hidden temporary name next to ``target``; ``~`` is in no valid key, so a
    listing never reports it."""
    return target.with_name(f".{target.name}.~{secrets.token_hex(6)}.tmp")


@contextlib.contextmanager
def download_to(target: Path) -> Iterator[Path]:
    """A temporary path next to ``target`` to download into; renamed over ``target``
    when the block succeeds, removed in any case, so ``target`` is never partial."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = temp_sibling(target)
    try:
        yield temp
        if not temp.exists():  # an empty object: a file still results
            temp.touch()
        os.replace(temp, target)
    finally:
        with contextlib.suppress(OSError):
            temp.unlink()


class BucketKeys:
    """The keys of a store that lives under a folder ``prefix`` of a bucket (S3, Hub
    buckets): each key joined to the prefix, and listings turned back into keys."""

    prefix: str
    _failures: tuple[type[Exception], ...] = (Exception,)  # what the backend's calls raise

    def _error(self, action: str, key: str, error: Exception) -> StoreError:
        raise NotImplementedError

    @contextlib.contextmanager
    def _failing(self, action: str, key: str) -> Iterator[None]:
        """The backend's errors in the block as one StoreError line (see ``_error``)."""
        try:
            yield
        except self._failures as error:
            raise self._error(action, key, error) from error

    def _key(self, key: str) -> str:
        return join_key(self.prefix, key)

    def _search(self, prefix: str) -> str:
        """The bucket-side prefix that lists the folder ``prefix`` ("" for all)."""
        folder = check_prefix(prefix)
        full = join_key(self.prefix, folder) if folder else self.prefix
        return f"{full}/" if full else ""

    def _relative(self, names: Iterable[str], search: str) -> Iterator[str]:
        """The keys of the bucket-side ``names`` under ``search``, sorted; other
        names (a prefix match on ``a/b`` must not leak ``a/bc``, foreign objects) are
        skipped."""
        strip = len(self.prefix) + 1 if self.prefix else 0
        keys = [
            name[strip:] for name in names if name.startswith(search) and is_valid_key(name[strip:])
        ]
        keys.sort()
        return iter(keys)


def check_prefix(prefix: str) -> str:
    """Return ``prefix`` without its trailing ``/`` ("" for the whole store), or raise ConfigError.

    A prefix names a folder: ``list("a/b")`` covers ``a/b/...`` but not ``a/bc``.
    """
    folder = prefix[:-1] if prefix.endswith("/") else prefix
    if folder:
        try:
            check_key(folder)
        except ConfigError:
            raise ConfigError(f"invalid key prefix {prefix!r}") from None
    return folder


def check_range(key: str, start: int, length: int) -> None:
    """Raise ConfigError unless ``start`` and ``length`` are non-negative."""
    if start < 0 or length < 0:
        raise ConfigError(f"invalid byte range start={start} length={length} for {key!r}")


def join_key(root: str, key: str) -> str:
    """``root`` (a possibly empty folder prefix without trailing /) joined with a checked key."""
    check_key(key)
    return f"{root}/{key}" if root else key


def put_if_absent(store: ObjectStore, key: str, data: bytes) -> bool:
    """Write ``key`` unless it exists; True when this call created it.

    Uses the backend's atomic create (``put_new``: file and S3) when it has one,
    so that of several concurrent writers exactly one wins; otherwise (an HF bucket,
    whose API has no conditional write) falls back to check-then-write, which is not
    race-free.
    """
    put_new = getattr(store, "put_new", None)
    if put_new is not None:
        return bool(put_new(key, data))
    if store.exists(key):
        return False
    store.put(key, data)
    return True


def read_bounded(store: ObjectStore, key: str, limit: int, *, what: str = "object") -> bytes:
    """An object's bytes when it holds at most ``limit`` (its declared size), else
    CorruptObjectError, without reading more than ``limit + 1`` bytes: a huge, sparse
    or endless object in place of a small one costs nothing. Backends with
    ``get_bounded`` (file, S3, HF bucket) cap the read itself; others are asked their
    size first."""
    get_bounded = getattr(store, "get_bounded", None)
    if get_bounded is not None:
        data = bytes(get_bounded(key, limit))
    else:
        size = store.size(key)
        if size > limit:
            raise CorruptObjectError(f"{what} {key} is {size} bytes, more than {limit} expected")
        data = store.get(key)
    if len(data) > limit:
        raise CorruptObjectError(f"{what} {key} is larger than the {limit} bytes expected")
    return data


def read_prefix(store: ObjectStore, key: str, length: int, *, what: str = "object") -> bytes:
    """At most the first ``length`` bytes of an object (all of a shorter one), reading no
    more: what a signature header is checked from before the rest is read. A FIFO or
    device in place of a file-store object is refused without blocking."""
    data = bytes(store.get_range(key, 0, length))
    if len(data) > length:
        raise CorruptObjectError(f"{what} {key}: the store answered more than {length} bytes")
    return data
