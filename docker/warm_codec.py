"""Compile the codec's numba kernels while the image is built (NUMBA_CACHE_DIR), so a
new container handles its first version at full speed instead of compiling first:
every level, content hash and float width (the routine: workers/warm.py)."""

from __future__ import annotations

from workers.warm import warm_all

if __name__ == "__main__":
    warm_all()
