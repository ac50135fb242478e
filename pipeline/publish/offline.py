"""Offline deltas between two checkpoints, with no store, Redis or workers.

A delta is a folder in the same form as a store version: ``manifest.json``
(kind "delta", run "offline", version 1 on parent 0) plus the part objects it
names. The manifest carries the base's state hash and, in ``extra``, each base
tensor's content hash, so ``apply`` can name the first tensor of a wrong base.
``apply`` writes its output in the base's form (one file for a file, the same
shards for a sharded folder) and atomically: a failed check leaves no output.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from pipeline.codec import (
    CODEC_NAME,
    CODEC_VERSION,
    DEFAULT_LEVEL,
    DeltaObject,
    apply_patch,
    encode_delta,
    read_delta,
)
from pipeline.errors import ConfigError, CorruptObjectError, MismatchError
from pipeline.format.checkpoints.checkpoint import INDEX_NAME, CheckpointReader
from pipeline.format.checkpoints.checkpoint_write import write_checkpoint, write_sharded
from pipeline.format.hashes.hashing import content_hash, sha256_bytes, state_hash
from pipeline.format.manifest import (
    MANIFEST_NAME,
    CodecInfo,
    Manifest,
    ObjectEntry,
    TensorEntry,
    compute_state_hash,
    now_iso,
    to_json,
)
from pipeline.format.manifest_parse import parse_manifest
from pipeline.format.matching import check_tensors
from pipeline.publish.parts import DEFAULT_PART_BYTES, plan_parts
from pipeline.publish.version import tensor_entry

log = structlog.get_logger(__name__)

OFFLINE_RUN = "offline"
OFFLINE_VERSION = 1
OFFLINE_PARENT = 0


@dataclass(frozen=True)
class DeltaSummary:
    path: Path
    manifest: Manifest
    changed: int  # elements that differ between base and new
    total: int  # elements in the checkpoint
    bytes: int  # bytes of the delta's objects


def _check_specs(base: CheckpointReader, new: CheckpointReader) -> None:
    for name in base.names():
        if name not in new:
            raise MismatchError(f"tensor {name!r} of {base.path} is missing from {new.path}")
        a, b = base.spec(name), new.spec(name)
        if a != b:
            raise MismatchError(
                f"tensor {name!r} is {a.dtype}{list(a.shape)} in {base.path} "
                f"but {b.dtype}{list(b.shape)} in {new.path}"
            )
    for name in new.names():
        if name not in base:
            raise MismatchError(f"tensor {name!r} of {new.path} is missing from {base.path}")


def _temp_dir(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def create_delta(
    base_path: str | os.PathLike[str],
    new_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    level: int = DEFAULT_LEVEL,
    part_bytes: int = DEFAULT_PART_BYTES,
) -> DeltaSummary:
    """Encode the bitwise difference from ``base_path`` to ``new_path`` into a folder."""
    out = Path(out_path)
    if out.exists():
        raise ConfigError(f"{out} already exists")
    with CheckpointReader(base_path) as base, CheckpointReader(new_path) as new:
        _check_specs(base, new)
        layout = plan_parts(((n, base.nbytes(n)) for n in base.names()), part_bytes)
        tmp = _temp_dir(out)
        try:
            objects: list[ObjectEntry] = []
            entries: list[TensorEntry] = []
            base_hashes: dict[str, str] = {}
            for key, names in layout:
                pairs = [(n, base.get(n), new.get(n)) for n in names]
                base_hashes.update((n, content_hash(b)) for n, b, _ in pairs)
                data = encode_delta(pairs, level)
                changed = {i.name: i.changed for i in read_delta(data, object_name=key).tensors}
                entries.extend(
                    tensor_entry(n, t, key, changed[n], digest=content_hash(t)) for n, _, t in pairs
                )
                (tmp / key).write_bytes(data)
                objects.append(ObjectEntry(key=key, size=len(data), sha256=sha256_bytes(data)))
                del pairs, data
            manifest = Manifest(
                run=OFFLINE_RUN,
                version=OFFLINE_VERSION,
                kind="delta",
                parent=OFFLINE_PARENT,
                anchor=OFFLINE_PARENT,
                codec=CodecInfo(name=CODEC_NAME, version=CODEC_VERSION, level=level),
                objects=tuple(objects),
                tensors=tuple(entries),
                state_hash=compute_state_hash(entries),
                created=now_iso(),
                extra={"base_hashes": base_hashes},
                parent_state_hash=state_hash(base_hashes.items()),
            )
            (tmp / MANIFEST_NAME).write_bytes(to_json(manifest))
            os.rename(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    changed_total = sum(t.changed for t in entries)
    total = sum(t.numel for t in entries)
    log.info("offline delta written", out=str(out), changed=changed_total, elements=total)
    return DeltaSummary(out, manifest, changed_total, total, manifest.total_bytes)


def read_delta_manifest(delta_path: str | os.PathLike[str]) -> Manifest:
    path = Path(delta_path) / MANIFEST_NAME
    try:
        data = path.read_bytes()
    except OSError:
        raise CorruptObjectError(f"delta {delta_path} has no readable {MANIFEST_NAME}") from None
    return parse_manifest(data, expected_kind="delta", source=str(path))


class _Objects:
    """A delta folder's objects, each checked against the manifest before use."""

    def __init__(self, folder: Path, manifest: Manifest) -> None:
        self.folder = folder
        self.manifest = manifest
        self._all: dict[str, DeltaObject] = {}

    def raw(self, entry: ObjectEntry) -> bytes:
        path = self.folder / entry.key
        try:
            data = path.read_bytes()
        except OSError:
            raise CorruptObjectError(f"delta object {path} is missing") from None
        if len(data) != entry.size or sha256_bytes(data) != entry.sha256:
            raise CorruptObjectError(f"delta object {path} does not match its size and sha256")
        return data

    def get(self, key: str) -> DeltaObject:
        # A sharded run's tensors span every rank's objects: all held (a delta's objects
        # are ~2% of the model), each read and checked once. Else one at a time.
        if key not in self._all:
            if not self.manifest.is_pieced:
                self._all.clear()  # drop the previous object before loading the next
            data = self.raw(self.manifest.object_entry(key))
            self._all[key] = read_delta(data, object_name=str(self.folder / key))
        return self._all[key]


def _base_hashes(manifest: Manifest) -> dict[str, str] | None:
    raw = manifest.extra.get("base_hashes")
    if isinstance(raw, dict) and all(isinstance(v, str) for v in raw.values()):
        return {str(k): str(v) for k, v in raw.items()}
    return None


def apply_delta(
    base_path: str | os.PathLike[str],
    delta_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
) -> Manifest:
    """Apply a delta folder to its base and write the result in the base's form.

    The base is checked (names, dtypes, shapes, content hashes) and every result
    tensor's hash is verified; any failure raises and leaves no output.
    """
    folder, out = Path(delta_path), Path(out_path)
    if out.exists():
        raise ConfigError(f"{out} already exists")
    manifest = read_delta_manifest(folder)
    if manifest.parent_state_hash is None:
        raise CorruptObjectError(f"delta {folder} does not name the state of its base")
    objects = _Objects(folder, manifest)
    for entry in manifest.objects:
        objects.raw(entry)  # every object intact before any work starts
    entries = {t.name: t for t in manifest.tensors}
    expected_base = _base_hashes(manifest)
    with CheckpointReader(base_path) as base:
        algorithm = check_tensors(manifest, base.specs(), holder=f"base {base.path}", complete=True)
        seen: dict[str, str] = {}

        def patched(names: list[str], last: bool) -> Iterator[tuple[str, torch.Tensor]]:
            for name in names:
                tensor = base.get(name)
                digest = algorithm.full(tensor)
                if expected_base is not None and expected_base.get(name) != digest:
                    raise MismatchError(
                        f"tensor {name!r} of base {base.path} is not the delta's base"
                    )
                seen[name] = digest
                entry = entries[name]
                for piece in entry.stored if entry.changed else ():
                    if not piece.changed:
                        continue
                    delta = objects.get(piece.object)
                    if not entry.pieces:
                        apply_patch(tensor, delta.decode(name, tensor))
                        continue
                    # A sharded run's piece: decoded against its region's elements.
                    region = entry.region(piece)
                    part = region.take(tensor).clone()
                    apply_patch(part, delta.decode(name, part))
                    region.put(tensor, part)
                if algorithm.full(tensor) != entry.hash:
                    raise CorruptObjectError(
                        f"delta {folder}: tensor {name!r} does not match its hash after apply"
                    )
                yield name, tensor
            if last and state_hash(seen.items()) != manifest.parent_state_hash:
                raise MismatchError(
                    f"base {base.path} is not the state delta {folder} was made from"
                )

        if base.path.is_dir():
            shards = base.shards()
            extra = {
                p.name: p
                for p in base.path.iterdir()
                if p.is_file() and p.name != INDEX_NAME and p.name not in dict(shards)
            }
            write_sharded(
                out,
                (
                    (fname, patched(names, i == len(shards) - 1))
                    for i, (fname, names) in enumerate(shards)
                ),
                metadata=base.metadata or None,
                extra_files=extra,
            )
        else:
            write_checkpoint(out, patched(base.names(), True), metadata=base.metadata or None)
    log.info("offline delta applied", base=str(base_path), delta=str(folder), out=str(out))
    return manifest


@dataclass(frozen=True)
class InspectRow:
    name: str
    dtype: str
    shape: tuple[int, ...]
    encoding: str
    changed: int
    bytes: int  # payload bytes of this tensor in its object


@dataclass(frozen=True)
class DeltaInspection:
    path: Path
    level: int
    rows: list[InspectRow]
    changed: int
    total: int
    bytes: int  # bytes of all objects (payload plus container headers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "level": self.level,
            "changed": self.changed,
            "total": self.total,
            "bytes": self.bytes,
            "tensors": [{**asdict(r), "shape": list(r.shape)} for r in self.rows],
        }


def inspect_delta(delta_path: str | os.PathLike[str]) -> DeltaInspection:
    """What a delta folder holds, tensor by tensor (objects are checked, not decoded)."""
    folder = Path(delta_path)
    manifest = read_delta_manifest(folder)
    objects = _Objects(folder, manifest)
    entries = {t.name: t for t in manifest.tensors}
    rows: list[InspectRow] = []
    for key, names in manifest.parts():
        obj = objects.get(key)
        for name in names:
            info = obj.info(name)
            t = entries[name]
            rows.append(
                InspectRow(name, t.dtype, t.shape, info.encoding, info.changed, info.nbytes)
            )
    return DeltaInspection(
        path=folder,
        level=manifest.codec.level,
        rows=rows,
        changed=sum(r.changed for r in rows),
        total=sum(t.numel for t in manifest.tensors),
        bytes=manifest.total_bytes,
    )
