"""Compiled inner loops for the hot paths, when numba is importable.

The numpy code in rice.py and tensorcodec.py is the reference and the
fallback; these loops produce byte-identical streams in one pass over the
data instead of several, which is what makes diffing and patching cost about
a copy of the weights. Compiled on first use and cached on disk.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Any

# Tests switch this off to exercise the numpy reference path.
ENABLED = True


def get() -> Any | None:
    """The compiled kernels, or None when disabled or numba is missing."""
    return _build() if ENABLED else None


@functools.cache
def _build() -> Any | None:
    # Module-level functions, so that numba's disk cache finds them again in the
    # next process (functions made inside a function are compiled anew each time).
    if importlib.util.find_spec("numba") is None:
        return None  # the numpy paths serve
    return importlib.import_module("pipeline.codec.compiled.kernels_jit").KERNELS
