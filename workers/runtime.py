"""What every entry point needs: settings, the store, Redis, logging."""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import click

from pipeline import kernel_cache
from pipeline.config import Settings
from pipeline.coord.connection import redact_url, redis_client
from pipeline.logs import configure_logging
from pipeline.store import open_store
from pipeline.store.base import ObjectStore
from pipeline.store.trust import process_key, trusted
from workers.redis_launcher import ensure_redis

if TYPE_CHECKING:
    import redis


@dataclass
class Runtime:
    """Lazily opened connections for one process, built from typed settings. With
    ``fail_fast`` (the trainer side) Redis calls give up after
    ``settings.redis_timeout_s`` and one retry instead of riding out an outage."""

    settings: Settings
    fail_fast: bool = False
    _redis_url: str | None = field(default=None, init=False)

    @cached_property
    def store(self) -> ObjectStore:
        """The store; with a verify or signing key, every manifest read from it must be
        signed by that key (see pipeline/store/trust.py)."""
        key = process_key(self.settings.signing_key(), self.settings.verify_key())
        return trusted(open_store(self.settings.store_url), key)

    @property
    def redis_url(self) -> str:
        if self._redis_url is None:
            self._redis_url = self.settings.redis_url or ensure_redis(self.settings.data_dir)
        return self._redis_url

    @property
    def redis_url_redacted(self) -> str:
        return redact_url(self.redis_url)

    @cached_property
    def redis(self) -> redis.Redis:
        if self.fail_fast:
            timeout = self.settings.redis_timeout_s
            return redis_client(
                self.redis_url, socket_timeout_s=timeout, connect_timeout_s=timeout, retries=1
            )
        return redis_client(self.redis_url)


_current: Runtime | None = None


def set_current(runtime: Runtime) -> None:
    """Entry points set the process's runtime; rq jobs then run with it."""
    global _current
    _current = runtime


def current() -> Runtime:
    """The process's runtime, built from the environment on first use."""
    global _current
    if _current is None:
        _current = Runtime(Settings.from_env())
        kernel_cache.choose(_current.settings.kernel_cache)
    return _current


# glibc's mallopt parameters (malloc.h), and the largest mmap threshold it accepts on
# 64-bit systems.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20
_OPERATOR_CHOSEN = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")


def keep_freed_memory() -> bool:
    """Let glibc's allocator keep what a torch rollout node frees for its next allocations:
    blocks up to 32 MiB come from the heap, and the heap is never trimmed. Every
    version allocates and frees the same buffers (a delta's changed positions and
    contents); handed back to the kernel, they page-fault in again, zeroed, each
    version: a replica's apply took 0.44-0.51 s instead of 0.32-0.34 s at 0.63B
    (docs/PERFORMANCE.md). Between versions a 0.63B node then holds about 110 MB
    more; its peak is unchanged. Left as it is where the operator set glibc's
    allocator variables, and off glibc. True when set."""
    chosen = any(v in os.environ for v in _OPERATOR_CHOSEN)
    if chosen or "malloc" in os.environ.get("GLIBC_TUNABLES", "") or sys.platform != "linux":
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) and mallopt(_M_TRIM_THRESHOLD, -1))


def from_context(ctx: click.Context) -> Runtime:
    """The runtime of a CLI invocation, built once from the root options."""
    obj = ctx.find_root().obj
    assert isinstance(obj, dict)
    runtime = obj.get("runtime")
    if runtime is None:
        settings = Settings.from_env(**obj["overrides"])
        configure_logging(settings.log_level, json=settings.log_json)
        kernel_cache.choose(settings.kernel_cache)
        runtime = Runtime(settings)
        set_current(runtime)
        obj["runtime"] = runtime
    assert isinstance(runtime, Runtime)
    return runtime
