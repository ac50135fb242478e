"""Lossless bitwise delta codec.

Public API (stable; other modules code against exactly this):

- ``CODEC_NAME``, ``CODEC_VERSION``, ``LEVELS``, ``DEFAULT_LEVEL``
- ``encode_delta(pairs, level=DEFAULT_LEVEL) -> bytes``: pairs of
  ``(name, base, new)`` tensors (same dtype and shape, any device) become one
  delta object: a safetensors file whose metadata names the codec.
- ``read_delta(data, object_name=...) -> DeltaObject``: parse and validate the
  container without decoding tensors (raises CorruptObjectError / CodecError).
- ``DeltaObject.tensors``: per-tensor ``EncodedTensorInfo`` (name, dtype,
  shape, encoding, changed, nbytes).
- ``DeltaObject.decode(name, base) -> TensorPatch``: positions (int64, flat,
  sorted) and new contents in the integer view of the dtype, computed from the
  stored bit-pattern differences and ``base`` (which must be the exact base).
- ``apply_patch(tensor, patch)``: in place, on any device.
"""

from pipeline.codec.api import (
    CODEC_NAME,
    CODEC_VERSION,
    DEFAULT_LEVEL,
    LEVELS,
    DeltaObject,
    EncodedTensorInfo,
    TensorPatch,
    apply_patch,
    encode_delta,
    read_delta,
)

__all__ = [
    "CODEC_NAME",
    "CODEC_VERSION",
    "DEFAULT_LEVEL",
    "LEVELS",
    "DeltaObject",
    "EncodedTensorInfo",
    "TensorPatch",
    "apply_patch",
    "encode_delta",
    "read_delta",
]
