"""Checkpoints: safetensors files and sharded folders of them, read.

Reading is lazy and memory-mapped (one private mapping a file); every header is parsed and
checked against the file size by hand first, so a truncated or half-written
checkpoint fails on open with one line naming the file instead of deep inside
a load. Writing is in ``pipeline.format.checkpoints.checkpoint_write``.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import re
import stat
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import structlog
import torch

from pipeline.errors import CorruptObjectError, MismatchError
from pipeline.format.bounded import load_json
from pipeline.format.tensors import DTYPE_TABLE, TensorSpec

log = structlog.get_logger(__name__)

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # the limit safetensors itself enforces

# safetensors header codes (pipeline/format/tensors.py).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {d.safetensors: d.dtype for d in DTYPE_TABLE}
SAFETENSORS_CODES: dict[torch.dtype, str] = {d.dtype: d.safetensors for d in DTYPE_TABLE}

Tensors = Iterable[tuple[str, torch.Tensor]]
T = TypeVar("T")


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor in a safetensors header; offsets are relative to the data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    entries: tuple[HeaderEntry, ...]  # in data-offset order
    metadata: dict[str, str]
    data_start: int  # 8 + header length


def header_bytes(
    tensors: Iterable[tuple[str, str, Iterable[int], int, int]],
    metadata: dict[str, str],
    *,
    ensure_ascii: bool = False,
) -> bytes:
    """A safetensors header: the 8-byte length, then the JSON of ``metadata`` (in the
    order given) and of each ``(name, dtype code, shape, begin, end)``, padded with
    spaces so that the data section starts 8-byte aligned. The one writer of headers:
    checkpoints, delta containers and compressed anchors. ``ensure_ascii`` keeps the
    delta containers' bytes as they always were (tensor names escaped)."""
    doc: dict[str, Any] = {"__metadata__": metadata}
    for name, code, shape, begin, end in tensors:
        doc[name] = {"dtype": code, "shape": list(shape), "data_offsets": [begin, end]}
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=ensure_ascii).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def parse_header(prefix: bytes | memoryview, total_size: int, source: str) -> SafetensorsHeader:
    """Parse and check a safetensors header.

    ``prefix`` holds at least the first ``8 + header length`` bytes of a file or
    buffer of ``total_size`` bytes; CorruptObjectError naming ``source`` if the
    header is absurd, malformed, or points past the end (a truncated file).
    """
    if total_size < 8 or len(prefix) < 8:
        raise CorruptObjectError(f"{source}: {total_size} bytes is too short for safetensors")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n < 2 or n > MAX_HEADER_BYTES or 8 + n > total_size:
        raise CorruptObjectError(
            # Not the length itself: it is the file's first 8 bytes, which may be secret.
            f"{source}: header length is absurd for a file of {total_size} bytes "
            "(not a safetensors file)"
        )
    if len(prefix) < 8 + n:
        raise CorruptObjectError(f"{source}: header is truncated")
    doc = load_json(
        bytes(prefix[8 : 8 + n]), max_bytes=n, what=f"{source}: header", error=CorruptObjectError
    )
    if not isinstance(doc, dict):
        raise CorruptObjectError(f"{source}: header is not a JSON object")
    body = total_size - 8 - n
    metadata_raw = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata_raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata_raw.items()
    ):
        raise CorruptObjectError(f"{source}: __metadata__ is not a string map")
    entries = [_header_entry(name, info, body, source) for name, info in doc.items()]
    entries.sort(key=lambda e: (e.begin, e.end))
    end = 0
    for e in entries:
        if e.begin < end:
            raise CorruptObjectError(f"{source}: tensor {e.name!r} overlaps another tensor")
        end = e.end
    if end != body:
        raise CorruptObjectError(
            f"{source}: data section is {body} bytes but the tensors cover {end}"
        )
    return SafetensorsHeader(tuple(entries), dict(metadata_raw), 8 + n)


def _header_entry(name: str, info: object, body: int, source: str) -> HeaderEntry:
    if not isinstance(info, dict):
        raise CorruptObjectError(f"{source}: entry {name!r} is not an object")
    dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise CorruptObjectError(
            f"{source}: tensor {name!r} has unknown dtype {info.get('dtype')!r}"
        )
    shape = info.get("shape")
    offsets = info.get("data_offsets")
    if (
        not isinstance(shape, list)
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        or not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise CorruptObjectError(f"{source}: tensor {name!r} has a malformed shape or offsets")
    begin, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if not 0 <= begin <= end or end - begin != nbytes:
        raise CorruptObjectError(
            f"{source}: tensor {name!r} offsets {begin}..{end} do not fit its shape {shape}"
        )
    if end > body:
        raise CorruptObjectError(
            f"{source}: tensor {name!r} ends at {end} past the data section ({body} bytes); "
            "truncated?"
        )
    return HeaderEntry(name, dtype, tuple(shape), begin, end)


# (device, inode, size) of a file as its header was read: a mapping made later must
# map that very file.
FileIdentity = tuple[int, int, int]


def read_file_header(path: Path) -> tuple[SafetensorsHeader, FileIdentity]:
    """Header of a safetensors file, checked against the file's size, and the file's
    identity as it was read."""
    try:
        # Non-blocking open, regular files only: a FIFO named as a checkpoint must not hang.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise CorruptObjectError(f"checkpoint file {path} is not a regular file")
            size = info.st_size
            head = f.read(8)
            if len(head) == 8:
                (n,) = struct.unpack("<Q", head)
                if 2 <= n <= MAX_HEADER_BYTES and 8 + n <= size:
                    head += f.read(n)
    except FileNotFoundError:
        raise CorruptObjectError(f"checkpoint file {path} is missing") from None
    except OSError as e:
        raise CorruptObjectError(f"checkpoint file {path} cannot be read: {e.strerror}") from None
    return parse_header(head, size, str(path)), (info.st_dev, info.st_ino, size)


def tensors_from_bytes(data: bytes, source: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of an in-memory safetensors buffer, in data order, as owned writable copies."""
    header = parse_header(data, len(data), source)
    view = memoryview(data)
    for e in header.entries:
        yield e.name, _from_buffer(view[header.data_start + e.begin : header.data_start + e.end], e)


def _from_buffer(buf: memoryview, e: HeaderEntry) -> torch.Tensor:
    if e.end == e.begin:
        return torch.empty(e.shape, dtype=e.dtype)
    raw = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
    return raw.view(e.dtype).reshape(e.shape)


# ---------------------------------------------------------------- reading

_NUMBERED_SHARD = re.compile(r"^(.*)-(\d+)-of-(\d+)\.safetensors$")


def _check_numbered_shards(folder: Path, names: list[str]) -> None:
    """Without an index, ``x-00001-of-00003.safetensors`` still says how many shards
    make the whole: a folder still being written must not look complete."""
    groups: dict[tuple[str, int], set[int]] = {}
    for name in names:
        m = _NUMBERED_SHARD.match(name)
        if m:
            groups.setdefault((m.group(1), int(m.group(3))), set()).add(int(m.group(2)))
    for (prefix, count), present in groups.items():
        missing = sorted(set(range(1, count + 1)) - present)
        if missing:
            raise CorruptObjectError(
                f"checkpoint folder {folder} lacks shard {missing[0]} of {count} ({prefix}-*) "
                f"and has no {INDEX_NAME}"
            )


class CheckpointReader:
    """A safetensors file or sharded folder, read lazily one tensor at a time.

    ``get`` returns an owned, writable CPU tensor; callers may patch it in
    place without touching the file or later ``get`` results.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.sharded = False
        self._files: list[Path] = []
        self._data_start: list[int] = []  # per file: where its data section begins
        self._identity: list[FileIdentity] = []  # per file: as its header was read
        self._entries: dict[str, tuple[int, HeaderEntry]] = {}
        self._order: list[str] = []
        self._maps: dict[int, memoryview] = {}
        self.metadata: dict[str, str] = {}
        if self.path.is_dir():
            self._open_folder()
        elif self.path.exists():
            self._add_file(self.path)
        else:
            raise CorruptObjectError(f"checkpoint {self.path} does not exist")
        if not self._order:
            raise CorruptObjectError(f"checkpoint {self.path} holds no tensors")

    def _open_folder(self) -> None:
        index = self.path / INDEX_NAME
        if index.exists():
            self.sharded = True
            try:
                doc = json.loads(index.read_bytes())
                weight_map = doc["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError
            except (OSError, ValueError, KeyError, TypeError, RecursionError):
                raise CorruptObjectError(f"checkpoint index {index} is malformed") from None
            shard_names: list[str] = []
            for shard in weight_map.values():
                if not isinstance(shard, str) or "/" in shard or shard in ("", ".", ".."):
                    raise CorruptObjectError(f"checkpoint index {index} names shard {shard!r}")
                if shard not in shard_names:
                    shard_names.append(shard)
            for shard in sorted(shard_names):
                if not (self.path / shard).is_file():
                    raise CorruptObjectError(
                        f"checkpoint index {index} names missing shard {shard}"
                    )
                self._add_file(self.path / shard)
            listed = set(weight_map)
            present = set(self._order)
            if listed != present:
                name = sorted(listed ^ present)[0]
                raise CorruptObjectError(
                    f"checkpoint index {index} and its shards disagree about tensor {name!r}"
                )
            for name, shard in weight_map.items():
                if self._files[self._entries[name][0]].name != shard:
                    raise CorruptObjectError(
                        f"checkpoint index {index}: {name!r} is not in {shard}"
                    )
        else:
            files = sorted(p for p in self.path.glob("*.safetensors") if p.is_file())
            if not files:
                raise CorruptObjectError(f"checkpoint folder {self.path} has no safetensors files")
            self.sharded = len(files) > 1
            _check_numbered_shards(self.path, [f.name for f in files])
            for f in files:
                self._add_file(f)

    def _add_file(self, path: Path) -> None:
        header, identity = read_file_header(path)
        i = len(self._files)
        self._files.append(path)
        self._identity.append(identity)
        self._data_start.append(header.data_start)
        if not self.metadata:
            self.metadata = header.metadata
        for e in header.entries:
            if e.name in self._entries:
                raise CorruptObjectError(f"checkpoint {self.path}: tensor {e.name!r} appears twice")
            self._entries[e.name] = (i, e)
            self._order.append(e.name)

    def names(self) -> list[str]:
        """Tensor names in file order (shard by shard, by data offset)."""
        return list(self._order)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._order)

    def _entry(self, name: str) -> tuple[int, HeaderEntry]:
        try:
            return self._entries[name]
        except KeyError:
            raise MismatchError(f"tensor {name!r} is not in checkpoint {self.path}") from None

    def spec(self, name: str) -> TensorSpec:
        e = self._entry(name)[1]
        return TensorSpec(dtype=e.dtype, shape=e.shape)

    def specs(self) -> dict[str, TensorSpec]:
        return {n: self.spec(n) for n in self._order}

    def nbytes(self, name: str) -> int:
        e = self._entry(name)[1]
        return e.end - e.begin

    @property
    def total_bytes(self) -> int:
        return sum(e.end - e.begin for _, e in self._entries.values())

    def shards(self) -> list[tuple[str, list[str]]]:
        """(file name, tensor names in file order) per file, in file order."""
        out: list[tuple[str, list[str]]] = [(p.name, []) for p in self._files]
        for name in self._order:
            out[self._entries[name][0]][1].append(name)
        return out

    def _map(self, i: int) -> memoryview:
        """File ``i`` mapped whole, privately (a stray write never reaches the file), if it
        is still the file whose header was read; the tensors viewing it keep it mapped,
        ``close`` only drops this reference."""
        held = self._maps.get(i)
        if held is None:
            try:
                with open(self._files[i], "rb") as f:
                    info = os.fstat(f.fileno())
                    if (info.st_dev, info.st_ino, info.st_size) != self._identity[i]:
                        raise CorruptObjectError(
                            f"checkpoint file {self._files[i]} was replaced or resized after "
                            "it was opened; open it again"
                        )
                    mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            except (OSError, ValueError) as ex:
                raise CorruptObjectError(f"checkpoint file {self._files[i]}: {ex}") from None
            held = self._maps[i] = memoryview(mapping)
        return held

    def view(self, name: str) -> torch.Tensor:
        """The tensor as a zero-copy view of the memory-mapped file: for reading only
        (never write it), valid while the file is unchanged. Saves a copy of every byte
        where the caller only compares or hashes. Built from the header parsed on open:
        the diff job's 438 views of a 0.63B pair take 1-4 ms, 7-33 ms through
        safetensors' own ``get_tensor``."""
        i, e = self._entry(name)
        count = math.prod(e.shape)
        if count == 0:
            return torch.empty(e.shape, dtype=e.dtype)
        flat = torch.frombuffer(
            self._map(i), dtype=e.dtype, count=count, offset=self._data_start[i] + e.begin
        )
        return flat.view(e.shape)

    def read_mapped(self, name: str, use: Callable[[torch.Tensor], T]) -> T:
        """``use(tensor)`` on a view of the tensor's own bytes, mapped from its file
        for the call and unmapped after it: one tensor resident at a time, without
        reopening the file per tensor (which re-reads its header: 2 ms a tensor in a
        file of 2,304). For reading only; ``use`` must not keep the tensor."""
        path, offset, length = self.location(name)
        entry = self._entry(name)[1]
        if length == 0:
            return use(torch.empty(entry.shape, dtype=entry.dtype))
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        try:
            with open(path, "rb") as f:
                # Private pages: a stray write would never reach the file.
                mapping = mmap.mmap(
                    f.fileno(), offset - start + length, access=mmap.ACCESS_COPY, offset=start
                )
        except (OSError, ValueError) as ex:
            raise CorruptObjectError(f"checkpoint file {path}: tensor {name!r}: {ex}") from None
        try:
            # Through a memoryview, which the tensor keeps: its export makes close()
            # refuse (BufferError) while the tensor lives. torch.frombuffer on the
            # mapping itself holds no export, and close() would unmap under it.
            flat = torch.frombuffer(
                memoryview(mapping),
                dtype=entry.dtype,
                count=math.prod(entry.shape),
                offset=offset - start,
            )
            result = use(flat.view(entry.shape))
            del flat
            return result
        finally:
            # BufferError: ``use`` kept the tensor, which unmaps it once it is freed.
            with contextlib.suppress(BufferError):
                mapping.close()

    def get(self, name: str) -> torch.Tensor:
        # Views share one private mapping: copy, so patching is safe.
        return self.view(name).clone()

    def location(self, name: str) -> tuple[Path, int, int]:
        """(file, byte offset of the tensor's data in it, byte length)."""
        i, e = self._entry(name)
        return self._files[i], self._data_start[i] + e.begin, e.end - e.begin

    def tensors(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self._order if names is None else names:
            yield name, self.get(name)

    def close(self) -> None:
        """Drop this reader's mappings; each is unmapped once no view of it is left."""
        held = list(self._maps.values())
        self._maps.clear()
        if held:
            unmap_later(held)

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_unmap_lock = threading.Lock()
_unmapper: tuple[int, ThreadPoolExecutor] | None = None


def unmap_later(held: list[memoryview]) -> Future[None]:
    """Drop ``held`` (the caller keeps no other reference) on a thread of its own.
    Unmapping a file in 4 KiB pages (a trainer's own checkpoint, a kernel copy) takes
    a core 6-10 ms a GB (16-23 ms for the diff job's 0.63B pair), which the diff job
    would spend between its parts and before its manifest; the thread unmaps while
    the encoders work. The returned future is done once they are dropped (and
    unmapped, where no view is left)."""
    global _unmapper
    with _unmap_lock:
        if _unmapper is None or _unmapper[0] != os.getpid():  # threads do not survive fork
            _unmapper = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="deltasync-unmap"))
        pool = _unmapper[1]
    return pool.submit(held.clear)
