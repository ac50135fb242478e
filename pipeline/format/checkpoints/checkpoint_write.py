"""Checkpoints written: safetensors files and sharded folders, atomically.

A file or a whole folder is written under a temporary sibling name and renamed
into place, so it appears complete or not at all. Tensors stream to disk one at
a time, so a checkpoint is never held in memory as a whole.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO

import torch

from pipeline.errors import ConfigError, MismatchError
from pipeline.format.checkpoints.checkpoint import (
    INDEX_NAME,
    SAFETENSORS_CODES,
    HeaderEntry,
    Tensors,
    header_bytes,
)
from pipeline.format.hashes.hashing import tensor_bytes


def _header_bytes(entries: list[HeaderEntry], metadata: dict[str, str] | None) -> bytes:
    # "format": "pt" is what transformers expects of a torch safetensors file.
    meta = {"format": "pt", **{str(k): str(v) for k, v in (metadata or {}).items()}}
    return header_bytes(
        ((e.name, SAFETENSORS_CODES[e.dtype], e.shape, e.begin, e.end) for e in entries), meta
    )


def _append_tensor(
    out: IO[bytes], name: str, tensor: torch.Tensor, offset: int, seen: set[str]
) -> HeaderEntry:
    if name in seen:
        raise MismatchError(f"tensor {name!r} is written twice")
    if tensor.dtype not in SAFETENSORS_CODES:
        raise MismatchError(f"tensor {name!r} has dtype {tensor.dtype} safetensors cannot hold")
    seen.add(name)
    data = tensor_bytes(tensor)
    out.write(data)
    return HeaderEntry(name, tensor.dtype, tuple(tensor.shape), offset, offset + len(data))


def safetensors_bytes(tensors: Tensors, metadata: dict[str, str] | None = None) -> bytes:
    """Serialise tensors (kept in the given order) into one safetensors buffer."""
    body = io.BytesIO()
    entries: list[HeaderEntry] = []
    seen: set[str] = set()
    for name, tensor in tensors:
        entries.append(_append_tensor(body, name, tensor, body.tell(), seen))
    return _header_bytes(entries, metadata) + body.getvalue()


# (name, dtype, shape) of each tensor a file will hold, in order.
Specs = Sequence[tuple[str, torch.dtype, tuple[int, ...]]]


def _entries_of(specs: Specs) -> list[HeaderEntry]:
    entries: list[HeaderEntry] = []
    offset = 0
    for name, dtype, shape in specs:
        if dtype not in SAFETENSORS_CODES:
            raise MismatchError(f"tensor {name!r} has dtype {dtype} safetensors cannot hold")
        end = offset + math.prod(shape) * dtype.itemsize
        entries.append(HeaderEntry(name, dtype, tuple(shape), offset, end))
        offset = end
    return entries


def _write_declared(
    path: Path, tensors: Tensors, metadata: dict[str, str] | None, specs: Specs
) -> int:
    """Stream tensors declared up front (``specs``) straight after their header: one
    write of the data, not two. MismatchError when a tensor is not what was declared."""
    entries = _entries_of(specs)
    seen: set[str] = set()
    with path.open("wb") as out:
        out.write(_header_bytes(entries, metadata))
        got = iter(tensors)
        for want in entries:
            item = next(got, None)
            if item is None:
                raise MismatchError(f"tensor {want.name!r} was declared and not given")
            name, tensor = item
            written = _append_tensor(out, name, tensor, want.begin, seen)
            if written != want:
                raise MismatchError(
                    f"tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, declared as "
                    f"{want.name!r} {want.dtype} {want.shape}"
                )
        extra = next(got, None)
        if extra is not None:
            raise MismatchError(f"tensor {extra[0]!r} was given and not declared")
        out.flush()
        os.fsync(out.fileno())
    return entries[-1].end if entries else 0


def _write_file(
    path: Path, tensors: Tensors, metadata: dict[str, str] | None, specs: Specs | None = None
) -> int:
    """Stream tensors into a safetensors file at ``path`` (not atomic); returns data bytes.

    The header comes first. With ``specs`` it is known before the data, which then
    streams right after it; otherwise it is known only at the end, so tensors stream
    into a body file that is then appended after the header.
    """
    if specs is not None:
        return _write_declared(path, tensors, metadata, specs)
    body_path = path.with_name(path.name + ".body")
    entries: list[HeaderEntry] = []
    seen: set[str] = set()
    try:
        with body_path.open("wb") as body:
            offset = 0
            for name, tensor in tensors:
                entry = _append_tensor(body, name, tensor, offset, seen)
                entries.append(entry)
                offset = entry.end
        with path.open("wb") as out, body_path.open("rb") as body:
            out.write(_header_bytes(entries, metadata))
            shutil.copyfileobj(body, out, 16 << 20)
            out.flush()
            os.fsync(out.fileno())
    finally:
        body_path.unlink(missing_ok=True)
    return offset


def _temp_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _publish(tmp: Path, path: Path, overwrite: bool) -> None:
    """Move a finished temp file/folder to ``path``."""
    if path.exists() or path.is_symlink():
        if not overwrite:
            raise ConfigError(f"{path} already exists")
        if tmp.is_file() and not path.is_dir():
            os.replace(tmp, path)
            _fsync_dir(path.parent)
            return
        # A folder cannot be swapped in one step: move the old one aside first.
        old = _temp_sibling(path)
        os.rename(path, old)
        os.rename(tmp, path)
        _remove(old)
    else:
        os.rename(tmp, path)
    _fsync_dir(path.parent)


@contextlib.contextmanager
def _staged(target: Path, overwrite: bool) -> Iterator[Path]:
    """A temp sibling of ``target`` to write, published as ``target`` when the block
    ends (removed if it fails)."""
    if (target.exists() or target.is_symlink()) and not overwrite:
        raise ConfigError(f"{target} already exists")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_sibling(target)
    try:
        yield tmp
        _publish(tmp, target, overwrite)
    except BaseException:
        _remove(tmp)
        raise


def write_sharded(
    path: str | os.PathLike[str],
    shards: Iterable[tuple[str, Tensors]],
    *,
    metadata: dict[str, str] | None = None,
    overwrite: bool = False,
    extra_files: dict[str, Path] | None = None,
) -> Path:
    """Write a sharded folder atomically: each shard is (file name, tensors), plus the index
    and copies of ``extra_files`` (name -> source, e.g. a model's config.json)."""
    target = Path(path)
    with _staged(target, overwrite) as tmp:
        tmp.mkdir()
        weight_map: dict[str, str] = {}
        total = 0
        for file_name, tensors in shards:
            if (
                "/" in file_name
                or not file_name.endswith(".safetensors")
                or file_name == INDEX_NAME
            ):
                raise ConfigError(f"invalid shard file name {file_name!r}")
            if (tmp / file_name).exists():
                raise ConfigError(f"shard {file_name} is written twice")

            def mapped(ts: Tensors, shard: str = file_name) -> Iterator[tuple[str, torch.Tensor]]:
                for name, tensor in ts:
                    if name in weight_map:
                        raise MismatchError(f"tensor {name!r} is written twice")
                    weight_map[name] = shard
                    yield name, tensor

            total += _write_file(tmp / file_name, mapped(tensors), metadata)
        index = {"metadata": {"total_size": total, **(metadata or {})}, "weight_map": weight_map}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        for name, source in (extra_files or {}).items():
            if "/" in name or (tmp / name).exists():
                raise ConfigError(f"extra file {name!r} clashes with the checkpoint's files")
            shutil.copyfile(source, tmp / name)
        _fsync_dir(tmp)
    return target


def _shard_by_size(
    tensors: Tensors, max_shard_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    group: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in tensors:
        n = tensor.numel() * tensor.element_size()
        if group and size + n > max_shard_bytes:
            yield group
            group, size = [], 0
        group.append((name, tensor))
        size += n
    if group:
        yield group


def write_checkpoint(
    path: str | os.PathLike[str],
    tensors: Tensors,
    *,
    max_shard_bytes: int | None = None,
    metadata: dict[str, str] | None = None,
    overwrite: bool = False,
    specs: Specs | None = None,
) -> Path:
    """Write tensors as one safetensors file, or as a sharded folder when ``max_shard_bytes``
    is given (shards of at most that many bytes, HF names and index). Atomic either way;
    a shard's tensors are held in memory only while that shard is written. ``specs``
    (one file only): every tensor's name, dtype and shape, in order, known before the
    data; the bytes are then written once instead of twice."""
    target = Path(path)
    if specs is not None and max_shard_bytes is not None:
        raise ConfigError("tensors declared up front are written as one file, not sharded")
    if max_shard_bytes is None:
        with _staged(target, overwrite) as tmp:
            _write_file(tmp, tensors, metadata, specs)
        return target
    if max_shard_bytes <= 0:
        raise ConfigError(f"max_shard_bytes must be positive, not {max_shard_bytes}")
    # Shard names carry the total count, known only at the end: number them
    # provisionally and rename inside the temp folder before it is published.
    groups = _shard_by_size(tensors, max_shard_bytes)
    names: list[str] = []

    def shards() -> Iterator[tuple[str, Tensors]]:
        for i, group in enumerate(groups):
            names.append(f"model-{i + 1:05d}.safetensors")
            yield names[-1], group

    return _write_hf_sharded(target, shards(), names, metadata, overwrite)


def _write_hf_sharded(
    target: Path,
    shards: Iterator[tuple[str, Tensors]],
    names: list[str],
    metadata: dict[str, str] | None,
    overwrite: bool,
) -> Path:
    with _staged(target, overwrite) as staging:
        write_sharded(staging, shards, metadata=metadata)
        count = len(names)
        renames = {n: f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i, n in enumerate(names)}
        for old, new in renames.items():
            os.rename(staging / old, staging / new)
        index_path = staging / INDEX_NAME
        index = json.loads(index_path.read_text())
        index["weight_map"] = {k: renames[v] for k, v in index["weight_map"].items()}
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return target
