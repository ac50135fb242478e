"""The fused compiled kernels (fused_jit.py) and their constants (fused_constants.py).

For the common case, few changes and small differences: one vectorised pass over
base and new finds the changes (``scan_diffs``), Rice-coded positions are written
and read a word at a time (``rice_write``/``rice_read``/``read_positions``), and
``walk_sparse``/``walk_records`` walk a ``sparse`` record's gaps and contents
together to apply, decode, gather, take back or confirm. They produce and consume
exactly the streams of rice.py and contents.py; numba is imported and they are
built on first use, cached on disk (pipeline.kernel_cache).
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


@functools.cache
def get() -> Any:
    """The fused kernels (numba is imported, and they are built, on first use)."""
    # Loaded by name: a process that never codes a delta never imports numba.
    return importlib.import_module("pipeline.codec.compiled.fused_jit")
