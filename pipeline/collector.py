"""Python's cyclic garbage collector held off while a version is on its way.

An apply allocates objects in proportion to its tensors (records, patches, tensor
views) that live until it ends: for a model of many small tensors, hundreds of
thousands. They fill the collector's young generations and, promoted, start full
collections that walk every object of the process, torch's, numba's and vLLM's
included: about 40% of a 5477-tensor apply (docs/PERFORMANCE.md). Reference counting
frees them all at the end; none is kept alive by a cycle. So the collector is held
off for the apply, and runs again after it. The same holds for the rest of a
version's critical path: the diff job until the version is announced (a full
collection there took 80 ms at 785 tensors), and a node's sync from the listing to
its last apply.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_holders = 0
_was_enabled = False


@contextlib.contextmanager
def held_off() -> Iterator[None]:
    """No cyclic collection inside (reference counting still frees memory). Nests
    and overlaps across threads: the collector is enabled again when the last one
    leaves, if it was enabled when the first came in."""
    global _holders, _was_enabled
    with _lock:
        if _holders == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _was_enabled:
                gc.enable()
