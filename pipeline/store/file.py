"""A local folder as an object store: ``file:///abs/path`` or a plain path.

Writes go to a temporary file in the destination folder, are fsynced and then
renamed over the key (``os.replace``), so a reader sees either the old object,
the new one, or none, never a partial one. Temporary names contain ``~``,
which no valid key may contain, so listing never reports them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO
from urllib.parse import unquote, urlsplit

from pipeline.errors import ConfigError, CorruptObjectError, ObjectNotFoundError, StoreError
from pipeline.store.base import check_key, check_prefix, check_range, is_valid_key, temp_sibling

_COPY_CHUNK = 8 << 20


def _fsync_dir(folder: Path) -> None:
    # Makes the rename itself durable; some filesystems refuse O_RDONLY on dirs.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomically(target: Path, fill: BinaryIO | bytes) -> None:
    """Write ``fill`` (bytes or a readable binary stream) to ``target`` atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = temp_sibling(target)
    try:
        with open(temp, "xb") as out:
            if isinstance(fill, bytes):
                out.write(fill)
            else:
                shutil.copyfileobj(fill, out, _COPY_CHUNK)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    _fsync_dir(target.parent)


class FileStore:
    """Objects are files under ``root``; keys map to relative paths."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).expanduser().resolve()
        self.url = self.root.as_uri()

    @classmethod
    def from_url(cls, url: str) -> FileStore:
        if "://" not in url:
            if not url:
                raise ConfigError("empty store path")
            return cls(url)
        parts = urlsplit(url)
        if parts.scheme != "file":
            raise ConfigError(f"not a file store URL: {url!r}")
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(f"file store URL must be local (file:///abs/path): {url!r}")
        path = unquote(parts.path)
        if not path:
            raise ConfigError(f"file store URL has no path: {url!r}")
        return cls(path)

    def __repr__(self) -> str:
        return f"FileStore({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        path = self.root.joinpath(*check_key(key).split("/"))
        # A symlink inside the store would send reads and writes elsewhere, and hide a
        # version from listing (os.walk does not follow it).
        if os.path.realpath(path) != str(path):
            raise StoreError(f"cannot use {key!r} in {self.url}: a path inside it is a symlink")
        return path

    def _store_error(self, action: str, key: str, error: OSError) -> StoreError:
        return StoreError(f"cannot {action} {key!r} in {self.url}: {error.strerror or error}")

    @contextlib.contextmanager
    def _failing(self, action: str, key: str) -> Iterator[None]:
        """A missing object as ObjectNotFoundError, any other OSError as one StoreError line."""
        try:
            yield
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as error:
            raise ObjectNotFoundError(f"object {key!r} not found in {self.url}") from error
        except OSError as error:
            raise self._store_error(action, key, error) from error

    def _write(self, key: str, fill: BinaryIO | bytes) -> None:
        target = self._path(key)
        # A concurrent delete may prune the folder between mkdir and open: retry.
        for attempt in range(3):
            try:
                _write_atomically(target, fill)
                return
            except FileNotFoundError as error:
                if attempt == 2:
                    raise self._store_error("write", key, error) from error
                if not isinstance(fill, bytes):
                    fill.seek(0)
            except OSError as error:
                raise self._store_error("write", key, error) from error

    def put(self, key: str, data: bytes) -> None:
        self._write(key, bytes(data))

    def put_new(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if it does not exist; False, writing nothing, if it does.

        The complete temporary file is hard-linked to the key, which fails
        atomically when the key exists, so concurrent creators cannot both win.
        """
        target = self._path(key)
        for attempt in range(3):
            temp = temp_sibling(target)
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(temp, "xb") as out:
                    out.write(bytes(data))
                    out.flush()
                    os.fsync(out.fileno())
                try:
                    os.link(temp, target)
                except FileExistsError:
                    return False
                _fsync_dir(target.parent)
                return True
            except FileNotFoundError as error:  # folder pruned by a concurrent delete
                if attempt == 2:
                    raise self._store_error("write", key, error) from error
            except OSError as error:
                raise self._store_error("write", key, error) from error
            finally:
                with contextlib.suppress(OSError):
                    temp.unlink()
        raise AssertionError("unreachable")

    def put_file(self, key: str, path: Path) -> None:
        try:
            source = open(path, "rb")  # noqa: SIM115 - closed below
        except OSError as error:
            raise StoreError(f"cannot read local file {str(path)!r}: {error.strerror}") from error
        with source:
            self._write(key, source)

    def get(self, key: str) -> bytes:
        path = self._path(key)
        with self._failing("read", key):
            return path.read_bytes()

    def _open_regular(self, key: str) -> BinaryIO:
        """The object's file opened for reading: a FIFO, device or folder in place of an
        object is refused without blocking, a link not followed."""
        path = self._path(key)
        with self._failing("read", key):
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        source = os.fdopen(fd, "rb")
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            source.close()
            raise StoreError(f"cannot read {key!r} in {self.url}: not a regular file")
        return source

    def get_bounded(self, key: str, limit: int) -> bytes:
        """At most ``limit + 1`` bytes of a regular file: a FIFO, device or folder in
        place of an object is refused without blocking, a huge one before reading it."""
        with self._open_regular(key) as source:
            size = os.fstat(source.fileno()).st_size
            if size > limit:
                raise CorruptObjectError(
                    f"object {key} is {size} bytes, more than {limit} expected"
                )
            with self._failing("read", key):
                return source.read(limit + 1)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        check_range(key, start, length)
        with self._open_regular(key) as source, self._failing("read", key):
            source.seek(start)
            return source.read(length)

    def get_file(self, key: str, path: Path) -> None:
        source_path = self._path(key)
        with self._failing("read", key):
            source = open(source_path, "rb")  # noqa: SIM115 - closed below
        with source:
            try:
                _write_atomically(Path(path), source)
            except OSError as error:
                raise StoreError(
                    f"cannot write {key!r} from {self.url} to {str(path)!r}: {error.strerror}"
                ) from error

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def size(self, key: str) -> int:
        path = self._path(key)
        with self._failing("stat", key):
            stat = path.stat()
        if not path.is_file():
            raise ObjectNotFoundError(f"object {key!r} not found in {self.url}")
        return stat.st_size

    def list(self, prefix: str) -> Iterator[str]:
        folder_key = check_prefix(prefix)
        folder = self.root.joinpath(*folder_key.split("/")) if folder_key else self.root
        if not folder.is_dir():
            return iter(())
        keys: list[str] = []
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = [name for name in dirnames if is_valid_key(name)]
            relative = Path(dirpath).relative_to(self.root).as_posix()
            base = "" if relative == "." else relative + "/"
            keys.extend(base + name for name in filenames if is_valid_key(name))
        keys.sort()
        return iter(keys)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return
        except OSError as error:
            raise self._store_error("delete", key, error) from error
        self._prune_empty_parents(path.parent)

    def _prune_empty_parents(self, folder: Path) -> None:
        # Keeps garbage-collected runs from leaving empty folder trees behind.
        while folder != self.root and self.root in folder.parents:
            try:
                folder.rmdir()
            except OSError:
                return
            folder = folder.parent
