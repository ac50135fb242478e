"""Compiled inner loops for the hot paths (numba).

They produce the streams of rice.py and contents.py in one pass over the data
instead of several, which is what makes diffing and patching cost about a copy of
the weights. tests/codec_reference.py holds the same format in plain numpy, and the
tests hold these loops to it byte for byte. Compiled on first use and cached on
disk.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any


@functools.cache
def get() -> Any:
    """The compiled kernels (numba is imported, and they are built, on first use)."""
    # Loaded by name: a process that never codes a delta never imports numba.
    return importlib.import_module("pipeline.codec.compiled.kernels_jit")
