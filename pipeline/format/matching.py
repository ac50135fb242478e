"""The one check that held tensors match a manifest's entries: name, dtype, shape,
and which content hash the manifest's hashes are in."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

import torch

from pipeline.errors import MismatchError
from pipeline.format.hashes import content_hashes
from pipeline.format.hashes.content_hashes import HashAlgorithm
from pipeline.format.manifest import Manifest, TensorEntry, dtype_name
from pipeline.format.tensors import DTYPES, TensorSpec


def spec_of(entry: TensorEntry) -> TensorSpec:
    """The dtype and shape a manifest entry says (MismatchError for an unknown dtype)."""
    dtype = DTYPES.get(entry.dtype)
    if dtype is None:
        raise MismatchError(f"tensor {entry.name!r}: unknown dtype {entry.dtype!r}")
    return TensorSpec(dtype, tuple(entry.shape))


def difference(want: TensorSpec, held: TensorSpec) -> Literal["dtype", "shape"] | None:
    """What differs between two specs, dtype first; None when they are equal."""
    if want.dtype != held.dtype:
        return "dtype"
    if tuple(want.shape) != tuple(held.shape):
        return "shape"
    return None


def describe(manifest: Manifest) -> str:
    """How the checks below name a version: ``delta run v3``."""
    return f"{manifest.kind} {manifest.run} v{manifest.version}"


def check_entry(
    entry: TensorEntry, held: Mapping[str, TensorSpec], *, of: str, holder: str
) -> TensorSpec:
    """One manifest tensor is held with the manifest's dtype and shape; returns the
    held spec. ``of`` names the manifest (``describe``), ``holder`` what holds the
    tensors ("the torch target", "checkpoint PATH")."""
    spec = held.get(entry.name)
    if spec is None:
        raise MismatchError(f"tensor {entry.name!r} of {of} is not in {holder}")
    want = spec_of(entry)
    what = difference(want, spec)
    if what == "dtype":
        raise MismatchError(
            f"tensor {entry.name!r} of {of}: dtype {entry.dtype} in the manifest, "
            f"{_dtype(spec.dtype)} in {holder}"
        )
    if what == "shape":
        raise MismatchError(
            f"tensor {entry.name!r} of {of}: shape {list(want.shape)} in the manifest, "
            f"{list(spec.shape)} in {holder}"
        )
    return spec


def check_tensors(
    manifest: Manifest,
    held: Mapping[str, TensorSpec],
    *,
    holder: str,
    complete: bool = False,
    entries: Iterable[TensorEntry] | None = None,
) -> HashAlgorithm:
    """Do these tensors match the manifest? Every entry (of ``entries``, default all of
    the manifest's) is held with its dtype and shape, and with ``complete`` every held
    name is in the manifest. Returns the content hash algorithm the manifest's hashes
    are in (CorruptObjectError when this build does not know it). One-line
    MismatchErrors."""
    algorithm = content_hashes.of(manifest)
    of = describe(manifest)
    for entry in manifest.tensors if entries is None else entries:
        check_entry(entry, held, of=of, holder=holder)
    if complete:
        named = {t.name for t in manifest.tensors}
        missing = [name for name in held if name not in named]
        if missing:
            raise MismatchError(
                f"{of} does not name held tensor {missing[0]!r} of {holder} "
                f"({len(missing)} missing in all)"
            )
    return algorithm


def _dtype(dtype: torch.dtype) -> str:
    try:
        return dtype_name(dtype)
    except MismatchError:  # held, though deltasync cannot move it: name it anyway
        return str(dtype).removeprefix("torch.")
