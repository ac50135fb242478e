"""Fused compiled kernels for the common case: few changes, small differences.

- ``scan_diffs``: one pass over base and new that compares 64 elements at a time
  as vectors (a bit mask of the differing lanes) and writes only the changed
  positions, their differences new - base and the base contents there (for a
  content hash of the change); no mask, no word index.
- ``signmag_diffs``: the sign-magnitude split of those differences.
- ``rice_write`` / ``rice_read`` / ``read_positions``: Rice-coded positions (rice.py's
  streams), written 8 bytes at a time and read a word at a time.
- ``walk_sparse``: walks the Rice-coded gaps and the contents (sign-magnitude,
  or zigzagged byte planes) of a ``sparse`` record together and either writes
  new = base + diff straight into the target (apply, recording the old contents
  if asked), only
  records positions and new contents (decode), records positions, new and old
  contents (gather, for a content hash of the change), or takes a prefix of an
  apply back (undo).
- ``walk_records``: ``walk_sparse`` of many records, each over its own target
  named by its address, in one call (every mode but UNDO; a write mode walks its
  failing record back): Python per call instead of per tensor, for models of many
  small tensors.

They produce and consume exactly the streams of rice.py and contents.py. A few
LLVM intrinsics (vector compare to a bit mask, count leading / trailing zeros,
big-endian 8-byte loads) are defined here with numba's ``intrinsic``; they are
what lets one core keep up with memory. Everything is built on first use and
cached on disk like kernels.py.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from pipeline.codec.compiled.fused_constants import (
    APPLY,
    BAD_BIG,
    BAD_CONTENTS,
    BAD_POSITION,
    BAD_READBACK,
    BAD_UNARY,
    BATCH,
    CONFIRM,
    DECODE,
    DIFFS,
    DONE,
    FALLBACK,
    GATHER,
    LANES,
    MAX_PARAM,
    RECORD_FIELDS,
    SIGNMAG_OF,
    SIGNMAG_ONES,
    UNDO,
)

__all__ = [
    "APPLY",
    "BAD_BIG",
    "BAD_CONTENTS",
    "BAD_POSITION",
    "BAD_READBACK",
    "BAD_UNARY",
    "BATCH",
    "CONFIRM",
    "DECODE",
    "DIFFS",
    "DONE",
    "FALLBACK",
    "GATHER",
    "LANES",
    "MAX_PARAM",
    "RECORD_FIELDS",
    "SIGNMAG_OF",
    "SIGNMAG_ONES",
    "UNDO",
    "get",
]


def get() -> Any:
    """The fused kernels (numba is imported, and they are built, on first use)."""
    return _build()


@functools.cache
def _build() -> Any:
    # Loaded by name: a process that never codes a delta never imports numba.
    return importlib.import_module("pipeline.codec.compiled.fused_jit").FUSED
