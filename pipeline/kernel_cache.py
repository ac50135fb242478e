"""Where the compiled kernels (numba) are kept on disk between processes.

Compiling the kernels a version's publish and apply use takes 5-30 s. numba's own
disk cache (``cache=True``) lies next to each source file and is keyed on that
file's path and modification time: every new virtual environment, reinstall or
checkout compiles again, and a change to a module a kernel inlines (constants,
intrinsics) goes unseen. The kernels here are cached instead in a folder of the
user's, keyed by a digest of every kernel source and of the compiler's versions
(numba adds the signature and the CPU to each entry): any environment on this
machine with the same kernels loads them, and a changed kernel is never served
stale.

The folder is ``$XDG_CACHE_HOME/deltasync/kernels``, else ``~/.cache/deltasync/kernels``;
a process's settings may choose another, or ``off`` for numba's own cache
(``DELTASYNC_KERNEL_CACHE``, applied by :func:`choose` before any kernel module is
imported). Where ``NUMBA_CACHE_DIR`` is set, numba's own cache in that folder serves
(the images and the bounds-checked test run set it). A folder that cannot be written
falls back to numba's own cache.

numba is imported by :func:`jit` only, never by importing this module.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from pipeline.errors import ConfigError

OFF = "off"
_chosen = ""  # Settings.kernel_cache: "" the user's cache folder, OFF, or a folder
_built = False  # a kernel module has been imported: a later choice has no effect

_ROOT = Path(__file__).resolve().parent
# Every source the kernels compile from, relative to pipeline/: a change to any of
# them is a new cache. tests/codec/test_kernel_cache.py checks that every module a kernel
# module imports from pipeline/ is listed.
KERNEL_SOURCES = (
    "intrinsics_jit.py",
    "codec/compiled/fused_constants.py",
    "codec/compiled/fused_jit.py",
    "codec/compiled/kernels_jit.py",
    "codec/level3/chunked_jit.py",
    "format/hashes/mixsum_keys.py",
    "format/hashes/mixsum_jit.py",
    "targets/confirmed_jit.py",
)


def choose(setting: str) -> None:
    """Cache the kernels where ``setting`` says (a process's ``kernel_cache`` setting:
    "" the user's cache folder, ``off`` numba's own cache, else a folder); before
    any kernel module is imported (ConfigError after)."""
    global _chosen
    setting = setting.strip()
    if setting == _chosen:
        return
    if _built:
        raise ConfigError("the kernel cache is chosen before the first kernel is imported")
    _chosen = setting


def folder(environ: Mapping[str, str] | None = None, setting: str | None = None) -> Path | None:
    """The cache folder for ``setting`` (default: the chosen one), or None where
    numba's own cache serves."""
    env = os.environ if environ is None else environ
    chosen = _chosen if setting is None else setting.strip()
    if env.get("NUMBA_CACHE_DIR") or chosen.lower() == OFF:
        return None
    if chosen:
        return Path(chosen).expanduser()
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "deltasync" / "kernels"


def digest(root: Path = _ROOT) -> str:
    """What the cached kernels are keyed by: the kernel sources under ``root``, the
    Python, numba and llvmlite versions, and whether numba checks bounds."""
    import llvmlite  # type: ignore[import-untyped]
    import numba  # type: ignore[import-untyped]

    h = hashlib.sha256()
    for name in KERNEL_SOURCES:
        h.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
    versions = (sys.version, numba.__version__, llvmlite.__version__, numba.config.BOUNDSCHECK)
    h.update(repr(versions).encode())
    return h.hexdigest()[:24]


def import_kernels() -> None:
    """Import numba and every kernel module on the calling thread. Two threads importing
    numba at once can each see it half-initialised, and a failed import leaves it broken
    for the process: a thread that compiles beside others (the warm-up) starts after this."""
    import importlib

    for name in KERNEL_SOURCES:
        if name.endswith("_jit.py"):
            importlib.import_module("pipeline." + name.removesuffix(".py").replace("/", "."))
    from numba.core import caching  # type: ignore[import-untyped]  # noqa: F401


@functools.cache
def _digest() -> str:
    return digest()


def jit(function: Callable[..., Any]) -> Any:
    """``numba.njit(cache=True, nogil=True)`` of ``function``, its disk cache in
    :func:`folder` under :func:`digest` (numba's own cache where that is None)."""
    import numba

    global _built
    _built = True
    place = folder()
    if place is None:
        return numba.njit(cache=True, nogil=True)(function)
    dispatcher = numba.njit(nogil=True)(function)
    # What ``cache=True`` would set up, with this module's locator first.
    dispatcher._cache = _cache_class()(dispatcher.py_func)
    return dispatcher


@functools.cache
def _cache_class() -> type:
    from numba.core import caching  # type: ignore[import-untyped]

    class Locator(caching._CacheLocator):  # type: ignore[misc]
        """The kernels' folder: one subfolder per digest, the digest as the stamp."""

        def __init__(self, py_func: Any, path: Path) -> None:
            self._lineno = py_func.__code__.co_firstlineno
            self._path = str(path)

        def get_cache_path(self) -> str:
            return self._path

        def get_source_stamp(self) -> str:
            return _digest()

        def get_disambiguator(self) -> str:
            return str(self._lineno)

        @classmethod
        def from_function(cls, py_func: Any, py_file: str) -> Locator | None:
            place = folder()
            if place is None:
                return None
            self = cls(py_func, place / _digest())
            try:
                self.ensure_cache_path()
            except OSError:
                return None  # numba's own locators are tried next
            return self

    class Impl(caching.CompileResultCacheImpl):  # type: ignore[misc]
        _locator_classes: ClassVar[list[type]] = [
            Locator,
            *caching.CompileResultCacheImpl._locator_classes,
        ]

    class KernelCache(caching.FunctionCache):  # type: ignore[misc]
        _impl_class = Impl

    return KernelCache
