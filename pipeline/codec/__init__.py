"""Lossless bitwise delta codec.

Public API (stable; other modules code against exactly this):

- ``CODEC_NAME``, ``CODEC_VERSION``, ``LEVELS``, ``DEFAULT_LEVEL``
- ``encode_delta(pairs, level=DEFAULT_LEVEL) -> bytes``: pairs of
  ``(name, base, new)`` tensors (same dtype and shape, any device) become one
  delta object: a safetensors file whose metadata names the codec. Every pair
  is taken (and checked) before any is encoded, and held until the object is
  written.
- ``read_delta(data, object_name=...) -> DeltaObject``: parse and validate the
  container without decoding tensors (raises CorruptObjectError / CodecError).
- ``DeltaObject.tensors``: per-tensor ``EncodedTensorInfo`` (name, dtype,
  shape, encoding, changed, nbytes).
- ``DeltaObject.decode(name, base) -> TensorPatch``: positions (int64, flat,
  sorted) and new contents in the integer view of the dtype, computed from the
  stored bit-pattern differences and ``base`` (which must be the exact base).
- ``apply_patch(tensor, patch)``: in place, on any device.
- ``DeltaObject.apply_to(name, tensor)``: the same as ``apply_patch(tensor,
  decode(name, tensor))`` in about one pass (CPU tensors, the common ``sparse`` /
  ``signmag`` records, compiled kernels). A damaged stream leaves ``tensor`` as it
  was.

Format (codec ``deltasync-bitdelta`` version 1): a safetensors file. Its
metadata holds ``codec``, ``codec_version``, ``level``, ``tensors`` (a JSON
list of records: name, dtype, shape, encoding, changed, streams as role ->
byte size in stored order, params) and ``checksum`` (xxh3-128 over the level,
the records and every entry). Each tensor with changes has one 1-d uint8 entry
named after it holding its streams back to back. Tensors are compared in the
integer view of their width; contents are the differences new - base of those
integers (wrapping), so decoding needs the exact base. Encodings: ``same``,
``sparse`` (Rice-coded gaps), ``bitmap`` (zstd of the change mask), ``dense`` (zstd byte
planes of every difference), ``chunked`` (level 3: chunks of 2**20 elements
that decode independently, each with its positions coded per magnitude bucket
of the base value and its contents; streams ``table``, ``bits``, ``mags``, see
``pipeline.codec.level3.chunked``); contents ``signmag`` or ``planes``. Encoding is
deterministic: the same inputs give the same bytes. Compiled kernels (numba)
write and read it on CPU tensors (level 3: a tensor's chunks on several threads);
other devices' tensors are read with torch operations. tests/codec_reference.py
holds level 1 in plain numpy, the form the kernels are tested against.

Anchors (``pipeline.codec.anchor``): ``encode_anchor(tensors, method)`` with
``method`` one of ``ANCHOR_COMPRESSIONS`` (``none``: plain safetensors;
``zstd``: lossless byte planes) and ``anchor_tensors(data, source)``, which
reads either form.
"""

from typing import TYPE_CHECKING, Any

from pipeline.codec.names import (
    ANCHOR_COMPRESSIONS,
    CODEC_NAME,
    CODEC_VERSION,
    DEFAULT_LEVEL,
    LEVELS,
)

if TYPE_CHECKING:
    from pipeline.codec.anchor import anchor_tensors, encode_anchor
    from pipeline.codec.api import (
        DeltaObject,
        EncodedTensorInfo,
        HashedPatch,
        TensorPatch,
        apply_patch,
        encode_delta,
        read_delta,
    )

# The rest is imported on first use: a process that only names a codec level (settings,
# `deltasync status`) never loads torch and the compiled kernels.
_LAZY = {
    "anchor_tensors": "pipeline.codec.anchor",
    "encode_anchor": "pipeline.codec.anchor",
    "DeltaObject": "pipeline.codec.api",
    "EncodedTensorInfo": "pipeline.codec.api",
    "HashedPatch": "pipeline.codec.api",
    "TensorPatch": "pipeline.codec.api",
    "apply_patch": "pipeline.codec.api",
    "encode_delta": "pipeline.codec.api",
    "read_delta": "pipeline.codec.api",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later uses skip this function
    return value


__all__ = [
    "ANCHOR_COMPRESSIONS",
    "CODEC_NAME",
    "CODEC_VERSION",
    "DEFAULT_LEVEL",
    "LEVELS",
    "DeltaObject",
    "EncodedTensorInfo",
    "HashedPatch",
    "TensorPatch",
    "anchor_tensors",
    "apply_patch",
    "encode_anchor",
    "encode_delta",
    "read_delta",
]
