"""Codec entry points: encode a delta object, read and validate one, decode, apply."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import xxhash

from pipeline import cpus
from pipeline.codec import compact, tensorcodec
from pipeline.codec.compiled import fused, kernels
from pipeline.codec.container import read_container, write_container
from pipeline.codec.dtypes import DtypeInfo, info_for, int_view_flat
from pipeline.codec.level3 import chunked, chunked_torch
from pipeline.codec.names import CODEC_NAME, CODEC_VERSION, DEFAULT_LEVEL, LEVELS, RETIRED_LEVELS
from pipeline.codec.records import TensorRecord, parse_record
from pipeline.codec.tensorcodec import (
    DamagedStreamError,
    Encoded,
    Helpers,
    ReadBackError,
    RecordWalk,
    WalkFailure,
    decode_differences,
    decode_tensor,
    encode_tensor,
    walk_applies,
    walk_records,
    walk_sparse,
)
from pipeline.errors import (
    CodecError,
    CorruptObjectError,
    DeltasyncError,
    MismatchError,
    TargetError,
)
from pipeline.format.bounded import load_json
from pipeline.format.hashes.hashing import patched_tensor_hash

# One thread per CPU: the scan for changes is bound by how fast one core pulls
# lines, not by the bus (two threads scan 2x faster on two CPUs, docs/PERFORMANCE.md).
ENCODE_THREADS = max(1, min(4, cpus.available()))


@dataclass(frozen=True)
class EncodedTensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    encoding: str  # "same" | "sparse" | "bitmap" | "dense" | "chunked" (level 3)
    changed: int
    nbytes: int  # payload bytes for this tensor in the object


@dataclass(frozen=True)
class TensorPatch:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    positions: torch.Tensor  # int64, flat indices into the tensor, sorted ascending
    values: torch.Tensor  # new contents, integer view of dtype (int16 for bf16), len == positions


@dataclass(frozen=True)
class HashedPatch:
    """A decoded patch with the old contents at its positions and the content hash
    (xxh3-128) of the base with the patch applied."""

    patch: TensorPatch
    old: torch.Tensor  # held contents at patch.positions, same dtype as patch.values
    digest: str


@dataclass(frozen=True)
class Gathered:
    """Positions, new and old contents (the dtype's integer view) of several tensors'
    changes back to back, as one walk of their streams found them
    (:meth:`DeltaObject.gathered_many`): ``names[k]``'s are at ``[bounds[k],
    bounds[k + 1])``."""

    names: list[str]
    positions: npt.NDArray[np.int64]
    new: npt.NDArray[Any]
    old: npt.NDArray[Any]
    bounds: list[int]

    def tensors(self, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions, new contents, old contents) of ``names[k]``, as torch tensors
        viewing this batch's arrays."""
        lo, hi = self.bounds[k], self.bounds[k + 1]
        return (
            torch.from_numpy(self.positions[lo:hi]),
            torch.from_numpy(self.new[lo:hi]),
            torch.from_numpy(self.old[lo:hi]),
        )


class DeltaObject:
    """A validated delta object; tensors are decoded one at a time on demand."""

    level: int
    tensors: list[EncodedTensorInfo]

    def __init__(
        self,
        object_name: str,
        level: int,
        records: list[TensorRecord],
        entries: dict[str, npt.NDArray[np.uint8]],
    ) -> None:
        self.object_name = object_name
        self.level = level
        self._records = {r.name: r for r in records}
        self._entries = entries
        self.tensors = [
            EncodedTensorInfo(
                name=r.name,
                dtype=r.info.dtype,
                shape=r.shape,
                encoding=r.encoding,
                changed=r.changed,
                nbytes=r.nbytes,
            )
            for r in records
        ]
        self._infos = {t.name: t for t in self.tensors}

    def info(self, name: str) -> EncodedTensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise MismatchError(f"delta object {self.object_name} has no tensor {name!r}") from None

    @contextlib.contextmanager
    def _named_damage(self, name: str) -> Iterator[None]:
        """A damaged stream of tensor ``name`` (either codec's error) as a one-line
        CorruptObjectError naming the object and the tensor."""
        try:
            yield
        except (DamagedStreamError, chunked.ChunkedError) as exc:
            raise CorruptObjectError(
                f"delta object {self.object_name}: tensor {name!r}: {exc}"
            ) from None

    def decode(self, name: str, base: torch.Tensor) -> TensorPatch:
        """The patch that turns ``base`` (the exact base version of this tensor) into
        the new version; positions and values live on ``base``'s device."""
        record = self._record(name, base)
        info = record.info
        base_flat = int_view_flat(base, info)
        if record.encoding == "chunked" and base.device.type != "cpu":
            assert record.layout is not None  # parse_record sets it
            streams = record.split(self._entries[name])
            with self._named_damage(name):
                at, new = chunked_torch.decode(
                    streams, record.layout, record.changed, base_flat, info
                )
            return TensorPatch(name, info.dtype, record.shape, at, new)
        if record.encoding == "chunked":
            target = base_flat.numpy().view(info.unsigned)
            positions, values, _ = self._walk_chunked(
                chunked.compiled(), record, target, write=False
            )
        else:
            with self._named_damage(name):
                positions, values = decode_tensor(
                    record.encoding,
                    record.changed,
                    record.split(self._entries.get(name, np.zeros(0, np.uint8))),
                    record.params,
                    base_flat=base_flat,
                    info=info,
                )
        at, new = torch.from_numpy(positions).to(base.device), _viewed(values, info)
        return TensorPatch(name, info.dtype, record.shape, at, new.to(base.device))

    def _walk_chunked(
        self, walker: Any, record: TensorRecord, target: npt.NDArray[Any], *, write: bool
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[Any], npt.NDArray[Any]]:
        """The compiled decode of a ``chunked`` record over ``target`` (flat, unsigned):
        positions, new and old contents; a damaged stream is a one-line
        CorruptObjectError naming the object and the tensor."""
        assert record.layout is not None  # parse_record sets it
        streams = record.split(self._entries[record.name])
        with self._named_damage(record.name):
            return chunked.decode(
                walker, streams, record.layout, record.changed, target, record.info, write=write
            )

    def decode_hashed(self, name: str, base: torch.Tensor) -> HashedPatch | None:
        """:meth:`decode` plus what a target checks before writing, in one pass over
        ``base`` (not written): the patch, the old contents at its positions, and
        the content hash of ``base`` with the patch applied, all in host memory.
        Positions and differences come from the streams alone; each chunk of ``base``
        is then copied into a small host buffer (from the GPU for a GPU tensor),
        patched and hashed while in cache. None where only :meth:`decode` applies
        (other encodings)."""
        found = self._differences(name, base)
        if found is None:
            return None
        positions, diffs = found
        walker = fused.get()
        record = self._records[name]
        info = record.info
        old, new = np.empty_like(diffs), np.empty_like(diffs)

        def patch_chunk(chunk: npt.NDArray[Any], start: int, lo: int, hi: int) -> None:
            unsigned = chunk.view(info.unsigned)
            walker.patch_chunk(unsigned, start, positions, diffs, lo, hi, old, new)

        digest = patched_tensor_hash(int_view_flat(base, info), positions, patch_chunk)
        at = torch.from_numpy(positions)
        patch = TensorPatch(name, info.dtype, record.shape, at, _viewed(new, info))
        return HashedPatch(patch, _viewed(old, info), digest)

    def differences(
        self, name: str, base: torch.Tensor
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.unsignedinteger[Any]]] | None:
        """(positions, new - old modulo the element width, as unsigned integers) of
        ``name``'s changed elements, from the streams alone: ``base`` (any device)
        gives the size and is not read. What a content hash updated from the changes
        needs, with the old contents gathered once. None where the positions depend
        on the base's contents (level 3's ``chunked``)."""
        found = self._differences(name, base)
        if found is not None:
            return found
        record = self._record(name, base)
        with self._named_damage(name):
            return decode_differences(
                record.encoding,
                record.changed,
                record.split(self._entries.get(name, np.zeros(0, np.uint8))),
                record.params,
                base.numel(),
                record.info,
            )

    def _differences(
        self, name: str, base: torch.Tensor
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.unsignedinteger[Any]]] | None:
        """(positions, new - old modulo the element width, as unsigned integers) of
        ``name``'s changed elements, read from the streams alone: ``base`` (any device)
        gives the size and is not read. None where the walk does not apply."""
        record = self._record(name, base)
        walker = _walker(record)
        if walker is None:
            return None
        if base.device.type == "cpu":
            target = int_view_flat(base, record.info).numpy().view(record.info.unsigned)
        else:  # the walk only bounds positions by its size: host pages never touched
            target = np.empty(base.numel(), record.info.unsigned)
        return self._walk(walker, name, record, target, fused.DIFFS)[:2]

    def gathered(
        self, name: str, base: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(positions, new contents, old contents) of ``name``'s changed elements, the
        contents in the dtype's integer view, ``base`` (a CPU tensor, not written) read
        at the changed positions within the one walk of the streams: what a content
        hash updated from the changes needs, and the patch. Level 3's chunked records
        give the same from their decode, which reads the base anyway. None where
        neither applies (another device or encoding: :meth:`differences` then)."""
        record = self._record(name, base)
        if base.device.type != "cpu":
            return None
        info = record.info
        is_chunked = record.encoding == "chunked"
        walker = chunked.compiled() if is_chunked else _walker(record)
        if walker is None:
            return None
        target = int_view_flat(base, info).numpy().view(info.unsigned)
        if is_chunked:
            where, new, old = self._walk_chunked(walker, record, target, write=False)
        else:
            where, new, old = self._walk(walker, name, record, target, fused.GATHER)
        return torch.from_numpy(where), _viewed(new, info), _viewed(old, info)

    def gathered_many(
        self, items: Sequence[tuple[str, torch.Tensor]]
    ) -> tuple[list[Gathered], dict[str, CorruptObjectError]]:
        """:meth:`gathered` of many tensors (name, held CPU tensor, not written) in one
        compiled walk per element width: what a model of many small tensors needs, with
        Python per call instead of per tensor. Returns the batches, and the error of
        each tensor whose streams are damaged (the tensors after it in its batch are
        left out). A tensor the walk does not apply to (see :meth:`walks`) is in
        neither: its caller takes it one at a time."""
        batches: list[Gathered] = []
        errors: dict[str, CorruptObjectError] = {}
        for info, names, walks in self._record_walks(items):
            where, new, old, bounds, failure = self._walk_records(walks, info, fused.GATHER)
            view = _numpy_dtype(info.view)
            done = len(bounds) - 1
            batches.append(
                Gathered(names[:done], where, new.view(view), old.view(view), bounds.tolist())
            )
            if failure is not None:
                index, _, reason = failure
                errors[names[index]] = CorruptObjectError(
                    f"delta object {self.object_name}: tensor {names[index]!r}: {reason}"
                )
        return batches, errors

    def apply_many(
        self, items: Sequence[tuple[str, torch.Tensor]], *, confirm: bool = False
    ) -> tuple[list[str], DeltasyncError | None]:
        """:meth:`apply_to` of many tensors (name, held CPU tensor that :meth:`walks`
        writes into) in one compiled walk per element width, with ``confirm`` as there.
        Returns the names written, and the error that stopped the walk (None when all
        were written): a damaged stream (CorruptObjectError) or, with ``confirm``, a
        position that did not read back (MismatchError). The tensor at fault is left as
        it was; the written ones are for the caller to take back (:meth:`undo_apply`).
        TargetError, nothing written, for a tensor the walk does not write."""
        groups = self._record_walks(items)
        if sum(len(names) for _, names, _ in groups) != len(items):
            raise TargetError(
                f"delta object {self.object_name}: a tensor of the batch cannot be walked in place"
            )
        written: list[str] = []
        mode = fused.CONFIRM if confirm else fused.APPLY
        for info, names, walks in groups:
            try:
                failure = self._walk_records(walks, info, mode)[4]
            except DeltasyncError as exc:  # nothing of this group written
                return written, exc
            if failure is None:
                written += names
                continue
            index, status, reason = failure
            written += names[:index]
            where = f"delta object {self.object_name}: tensor {names[index]!r}"
            if status == fused.BAD_READBACK:
                return written, MismatchError(
                    f"tensor {names[index]}: read back after the write: {reason}"
                )
            return written, CorruptObjectError(f"{where}: {reason}")
        return written, None

    def _record_walks(
        self, items: Sequence[tuple[str, torch.Tensor]]
    ) -> list[tuple[DtypeInfo, list[str], list[RecordWalk]]]:
        """The compiled walk's records of ``items`` (name, CPU tensor), grouped by the
        dtype's integer view, leaving out those it does not walk (see :meth:`walks`)."""
        groups: dict[torch.dtype, tuple[DtypeInfo, list[str], list[RecordWalk]]] = {}
        for name, base in items:
            record = self._record(name, base)
            info = record.info
            if (
                base.device.type != "cpu"
                or record.changed == 0
                or not walk_applies(record.encoding, record.params, info)
                or not base.is_contiguous()
            ):
                continue
            group = groups.get(info.view)  # one integer view a batch (int8, uint8 differ)
            if group is None:
                group = groups[info.view] = (info, [], [])
            group[1].append(name)
            group[2].append(
                RecordWalk(
                    self._entries[name],
                    tuple(record.streams.values()),
                    record.params,
                    record.changed,
                    base.data_ptr(),
                    base.numel(),
                )
            )
        return list(groups.values())

    def _walk_records(
        self, walks: list[RecordWalk], info: DtypeInfo, mode: int
    ) -> tuple[Any, Any, Any, Any, WalkFailure | None]:
        try:
            return walk_records(fused.get(), walks, info, mode)
        except (KeyError, TypeError, ValueError) as exc:  # params a damaged record holds
            raise CorruptObjectError(f"delta object {self.object_name}: {exc}") from None

    def walks(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether :meth:`apply_to` of ``name`` into ``tensor`` decodes straight into it
        with the compiled walk, so that :meth:`undo_apply` can take it back."""
        record = self._record(name, tensor)
        return tensor.device.type == "cpu" and _walker(record) is not None

    def apply_to(self, name: str, tensor: torch.Tensor, *, confirm: bool = False) -> None:
        """Turn ``tensor`` (holding the exact base version of this tensor) into the new
        version in place, decoding straight into it where that is possible (CPU
        tensors, the common encodings): the same result as
        ``apply_patch(tensor, self.decode(name, tensor))`` in about one pass.

        A damaged stream raises CorruptObjectError and leaves ``tensor`` as it was.
        With ``confirm`` (only where :meth:`walks`), each batch of written positions
        is read back from ``tensor`` within the walk: MismatchError, with what was
        written walked back, if one does not hold its new contents."""
        record = self._record(name, tensor)
        info = record.info
        if record.changed == 0:
            return
        if confirm and not self.walks(name, tensor):
            raise TargetError(f"tensor {name!r}: a confirmed write needs the compiled walk")
        is_chunked = record.encoding == "chunked"
        if tensor.device.type != "cpu" or not (
            is_chunked or walk_applies(record.encoding, record.params, info)
        ):
            apply_patch(tensor, self.decode(name, tensor))
            return
        if not tensor.is_contiguous():
            raise TargetError(f"tensor {name!r}: cannot patch a non-contiguous tensor in place")
        target = tensor.detach().view(info.view).view(-1).numpy().view(info.unsigned)
        if is_chunked:
            self._walk_chunked(chunked.compiled(), record, target, write=True)
            return
        mode = fused.CONFIRM if confirm else fused.APPLY
        try:
            self._walk(fused.get(), name, record, target, mode, record_out=False)
        except ReadBackError as exc:
            raise MismatchError(f"tensor {name}: read back after the write: {exc}") from None

    def undo_apply(self, name: str, tensor: torch.Tensor) -> None:
        """Take back a completed :meth:`apply_to` of ``name`` (one that decoded straight
        into ``tensor``), walking the streams again: old = new - difference, so no old
        contents need to be kept. Only for tensors that :meth:`decode_hashed` handles."""
        record = self._record(name, tensor)
        if record.changed == 0:
            return
        if not self.walks(name, tensor):
            raise TargetError(f"tensor {name!r}: its delta cannot be walked back in place")
        target = tensor.detach().view(record.info.view).view(-1).numpy().view(record.info.unsigned)
        self._walk(fused.get(), name, record, target, fused.UNDO, record_out=False)

    def _walk(
        self,
        walker: Any,
        name: str,
        record: TensorRecord,
        target: npt.NDArray[Any],
        mode: int,
        *,
        record_out: bool = True,
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[Any], npt.NDArray[Any]]:
        """``walk_sparse`` over ``name``'s streams; a damaged stream is a one-line
        CorruptObjectError naming the object and the tensor."""
        with self._named_damage(name):
            return walk_sparse(
                walker,
                record.split(self._entries[name]),
                record.params,
                record.changed,
                target,
                record.info,
                mode,
                record=record_out,
            )

    def _record(self, name: str, base: torch.Tensor) -> TensorRecord:
        record = self._records.get(name)
        if record is None:
            raise MismatchError(f"delta object {self.object_name} has no tensor {name!r}")
        if base.dtype != record.info.dtype or tuple(base.shape) != record.shape:
            raise MismatchError(
                f"delta object {self.object_name}: tensor {name!r}: base is {base.dtype} "
                f"{tuple(base.shape)}, delta expects {record.info.dtype} {record.shape}"
            )
        return record


@functools.cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype[np.integer]:
    return torch.empty(0, dtype=dtype).numpy().dtype


def _viewed(values: npt.NDArray[Any], info: DtypeInfo) -> torch.Tensor:
    """Unsigned contents as a tensor of the dtype's integer view (sharing memory)."""
    return torch.from_numpy(values.view(_numpy_dtype(info.view)))


def _walker(record: TensorRecord) -> Any | None:
    """The compiled walk for a record it handles (changed, sparse positions, either
    contents), else None."""
    if record.changed == 0 or not walk_applies(record.encoding, record.params, record.info):
        return None
    return fused.get()


def encode_delta(
    pairs: Iterable[tuple[str, torch.Tensor, torch.Tensor]],
    level: int = DEFAULT_LEVEL,
    *,
    on_changes: Callable[[str, npt.NDArray[np.int64], npt.NDArray[Any], npt.NDArray[Any]], None]
    | None = None,
) -> bytes:
    """One delta object for (name, base, new) pairs of equal dtype and shape.
    ``on_changes(name, positions, new - base, base)`` is called once for each changed
    tensor with every change the encoder's scan found (checked against what was
    encoded), in the unsigned integer view (on an encoding thread; the arrays are
    valid during the call only), so that a caller needs no second pass over the
    changes nor over the base, nor a parse of the object for its counts. Every pair
    is checked before any is encoded; the tensors are then encoded on ENCODE_THREADS
    threads, the largest first, and the scans of the largest in pieces on all of them."""
    if level in RETIRED_LEVELS:
        raise CodecError(f"codec {CODEC_NAME}: {RETIRED_LEVELS[level]}")
    if level not in LEVELS:
        raise CodecError(f"codec {CODEC_NAME}: unknown level {level!r}, expected one of {LEVELS}")
    entries: dict[str, npt.NDArray[np.uint8]] = {}
    written: list[TensorRecord] = []
    # Every pair is checked before any is encoded: a bad one fails the object whole.
    tasks: list[tuple[str, DtypeInfo, torch.Tensor, torch.Tensor]] = []
    seen: set[str] = set()
    for name, base, new in pairs:
        if name in seen:
            raise CodecError(f"tensor {name!r} appears twice in one delta")
        if name == "__metadata__":
            raise CodecError("a tensor cannot be named '__metadata__' in a safetensors file")
        seen.add(name)
        if base.dtype != new.dtype or base.shape != new.shape:
            raise MismatchError(
                f"tensor {name!r}: base is {base.dtype} {tuple(base.shape)}, new is "
                f"{new.dtype} {tuple(new.shape)}"
            )
        tasks.append((name, info_for(base.dtype, name), base, new))

    def encode(
        name: str,
        info: DtypeInfo,
        base: torch.Tensor,
        new: torch.Tensor,
        helpers: Helpers | None = None,
    ) -> Encoded:
        base_flat = int_view_flat(base, info)
        new_flat = int_view_flat(new.to(base.device), info)
        if on_changes is None:
            return encode_tensor(base_flat, new_flat, info, level, None, helpers)
        told: list[int] = []

        def hook(positions: npt.NDArray[np.int64], diffs: Any, old: Any) -> None:
            told.append(positions.size)
            on_changes(name, positions, diffs, old)

        encoded = encode_tensor(base_flat, new_flat, info, level, hook, helpers)
        if sum(told) != encoded.changed:  # a caller's hashes and counts rest on this
            raise CodecError(
                f"tensor {name!r}: the encoder reported {sum(told)} changes for "
                f"{encoded.changed} encoded"
            )
        return encoded

    pool = _encode_pool() if ENCODE_THREADS > 1 else None
    if pool is None:
        encodings = [encode(*task) for task in tasks]
    else:
        # The large tensors are encoded on this thread, the pool's threads taking pieces
        # of their scans once they are free; the others go to the pool largest first,
        # so that no large one is left for last while the other threads idle.
        helpers = Helpers(pool.submit, ENCODE_THREADS)
        size = [task[2].numel() for task in tasks]
        large = [i for i in range(len(tasks)) if size[i] >= tensorcodec.SPLIT_SCAN_ELEMENTS]
        rest = sorted(set(range(len(tasks))) - set(large), key=lambda i: -size[i])
        futures = {i: pool.submit(encode, *tasks[i]) for i in rest}
        done: dict[int, Encoded] = {}
        try:
            for i in large:
                done[i] = encode(*tasks[i], helpers)
            for i, future in futures.items():
                done[i] = future.result()
        finally:
            for future in futures.values():
                future.cancel()
            for future in futures.values():
                if not future.cancelled():
                    future.exception()  # wait: the caller may free the tensors next
        encodings = [done[i] for i in range(len(tasks))]
    for (name, info, base, _), encoded in zip(tasks, encodings, strict=True):
        sizes = {role: int(stream.size) for role, stream in encoded.streams.items()}
        if encoded.blob is not None:
            entries[name] = encoded.blob
        elif encoded.streams:
            entries[name] = np.concatenate(list(encoded.streams.values()))
        written.append(
            TensorRecord(
                name, info, tuple(base.shape), encoded.encoding, encoded.changed, sizes,
                encoded.params,
            )
        )  # fmt: skip
    return pack_object(written, entries, level)


def pack_object(
    records: list[TensorRecord], entries: dict[str, npt.NDArray[np.uint8]], level: int
) -> bytes:
    """The delta object of encoded tensors: their records (packed at the compact
    levels), the streams, and the checksum over both, in one container."""
    if level in compact.COMPACT_LEVELS:
        tensors_json, entries = compact.pack(records, entries)
    else:
        tensors_json = json.dumps([r.to_json() for r in records], separators=(",", ":"))
    metadata = {
        "codec": CODEC_NAME,
        "codec_version": str(CODEC_VERSION),
        "level": str(level),
        "tensors": tensors_json,
        "checksum": _checksum(str(level), tensors_json, entries),
    }
    return write_container(entries, metadata)


_pool_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None


def _encode_pool() -> ThreadPoolExecutor:
    """One long-lived pool per process: its threads keep their scratch buffers and
    zstd contexts warm between deltas (a fresh pool would fault them in again)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():  # threads do not survive fork
            _pool = (os.getpid(), ThreadPoolExecutor(ENCODE_THREADS, "deltasync-encode"))
        return _pool[1]


def _checksum(level: str, tensors_json: str, entries: dict[str, npt.NDArray[np.uint8]]) -> str:
    """xxh3-128 over everything the decoder reads, so damage anywhere is caught up
    front rather than decoded into wrong weights."""
    h = xxhash.xxh3_128()
    h.update(f"{level}\0{tensors_json}\0".encode())
    for name in sorted(entries):
        blob = entries[name]
        h.update(f"{name}\0{blob.size}\0".encode())
        h.update(memoryview(np.ascontiguousarray(blob).data))
    return f"xxh3-128:{h.hexdigest()}"


def read_delta(data: bytes, *, object_name: str = "<delta>") -> DeltaObject:
    """Parse and validate a delta object; decoding happens per tensor later."""
    container = read_container(data, object_name)
    meta = container.metadata
    codec = meta.get("codec")
    if codec != CODEC_NAME:
        raise CodecError(f"delta object {object_name}: unknown codec {codec!r}")
    version = meta.get("codec_version")
    if version != str(CODEC_VERSION):
        raise CodecError(
            f"delta object {object_name}: unsupported {CODEC_NAME} version {version!r}"
        )
    level_text = meta.get("level", "")
    tensors_json = meta.get("tensors", "")
    if meta.get("checksum") != _checksum(level_text, tensors_json, container.streams):
        raise CorruptObjectError(
            f"delta object {object_name}: checksum mismatch, object is damaged"
        )
    retired = {str(x): why for x, why in RETIRED_LEVELS.items()}.get(level_text)
    if retired is not None:
        raise CodecError(f"delta object {object_name}: {retired}")
    if level_text not in {str(x) for x in LEVELS}:
        raise CorruptObjectError(f"delta object {object_name}: bad level {level_text!r}")
    raw_records = load_json(
        tensors_json,
        max_bytes=len(tensors_json),
        what=f"delta object {object_name}: tensor list",
        error=CorruptObjectError,
    )
    if not isinstance(raw_records, list):
        raise CorruptObjectError(f"delta object {object_name}: tensor list is not a list")
    entries = container.streams
    if int(level_text) in compact.COMPACT_LEVELS:
        raw_records, entries = compact.unpack(raw_records, container.streams, object_name)
    records = [parse_record(raw, entries, object_name, i) for i, raw in enumerate(raw_records)]
    names = [r.name for r in records]
    if len(set(names)) != len(names):
        raise CorruptObjectError(f"delta object {object_name}: a tensor name appears twice")
    stray = set(entries) - set(names)
    if stray:
        raise CorruptObjectError(
            f"delta object {object_name}: entry {sorted(stray)[0]!r} belongs to no tensor record"
        )
    return DeltaObject(object_name, int(level_text), records, entries)


def apply_patch(tensor: torch.Tensor, patch: TensorPatch) -> None:
    """Write the patch into ``tensor`` in place (any device; contiguous tensors only)."""
    if tensor.dtype != patch.dtype or tuple(tensor.shape) != patch.shape:
        raise MismatchError(
            f"tensor {patch.name!r}: target is {tensor.dtype} {tuple(tensor.shape)}, patch is "
            f"for {patch.dtype} {patch.shape}"
        )
    if not tensor.is_contiguous():
        raise TargetError(f"tensor {patch.name!r}: cannot patch a non-contiguous tensor in place")
    info = info_for(patch.dtype, patch.name)
    count = patch.positions.numel()
    if (
        patch.positions.dtype != torch.int64
        or patch.positions.dim() != 1
        or patch.values.dtype != info.view
        or tuple(patch.values.shape) != (count,)
    ):
        raise CodecError(f"tensor {patch.name!r}: malformed patch")
    if count == 0:
        return
    flat = tensor.detach().view(info.view).view(-1)
    out_of_range = CodecError(f"tensor {patch.name!r}: patch position out of range")
    if flat.device.type == "cpu" and patch.positions.device.type == "cpu":
        # A compiled loop scatters several times faster than index_copy_ on CPU.
        target, where, new = flat.numpy(), patch.positions.numpy(), patch.values.numpy()
        if kernels.get().scatter(target, where, new) < 0:
            raise out_of_range
        return
    positions = patch.positions.to(flat.device)
    if int(positions.min()) < 0 or int(positions.max()) >= flat.numel():
        raise out_of_range
    flat.index_copy_(0, positions, patch.values.to(flat.device))
