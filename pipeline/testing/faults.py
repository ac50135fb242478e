"""Crash points for fault-injection tests.

Code calls ``point("publish.before_manifest")`` at places where a crash must
leave a consistent store. Nothing happens unless a fault is armed for that
point; then the process kills itself with SIGKILL, exactly as an
out-of-memory kill or a pulled plug would, without running ``finally`` blocks
or atexit handlers.

A fault is armed by naming the point, optionally with ``@N`` to die the N-th
time the point is reached in this process (``publish.after_upload@2``: after
the second object upload):

- ``DELTASYNC_FAULT``: for the whole life of the process;
- ``DELTASYNC_FAULT_FILE``: a file holding the name, read at each point and
  removed when the fault fires, so a long-lived process (a worker restarted
  after each kill) can be armed again and again from outside.

A name prefixed ``stop:`` (``stop:publish.after_read``) stops the process with
SIGSTOP instead, as a paused VM or a debugger would: it goes on where it stopped
once sent SIGCONT.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from pipeline.config import armed_fault, fault_file

_passes: Counter[str] = Counter()  # per point, since the process started
_file_passes: Counter[tuple[str, int, int]] = Counter()  # per arming of the fault file
_local = threading.local()


@contextlib.contextmanager
def disarmed() -> Iterator[None]:
    """Points reached on this thread meanwhile neither fire nor count: work that is
    not the process's own (the kernel warm-up on its thread) must not move a fault."""
    before = getattr(_local, "off", False)
    _local.off = True
    try:
        yield
    finally:
        _local.off = before


STOP_PREFIX = "stop:"


def _split(armed: str) -> tuple[str, int]:
    name, _, nth = armed.strip().removeprefix(STOP_PREFIX).partition("@")
    return name, int(nth) if nth.isdigit() else 1


def _stops(armed: str) -> bool:
    return armed.strip().startswith(STOP_PREFIX)


def _armed_in_file(name: str) -> str | None:
    """The armed text when the file's fault fires here, else None."""
    path = Path(fault_file())
    try:
        armed = path.read_text()
        stat = path.stat()
    except OSError:
        return None
    point_name, nth = _split(armed)
    if point_name != name:
        return None
    # Passes count from the moment the file was (re)written, not from process start.
    arming = (armed, stat.st_mtime_ns, stat.st_ino)
    _file_passes[arming] += 1
    if _file_passes[arming] != nth:
        return None
    with contextlib.suppress(OSError):
        path.unlink()  # fire once: the restarted process runs clean
    return armed


def point(name: str) -> None:
    """Die here, abruptly, when a fault is armed for ``name`` (see the module doc)."""
    if getattr(_local, "off", False):
        return
    env = armed_fault()
    fired: str | None = None
    if env is not None:
        _passes[name] += 1
        point_name, nth = _split(env)
        fired = env if point_name == name and _passes[name] == nth else None
    if fired is None and fault_file():
        fired = _armed_in_file(name)
    if fired is None:
        return
    if _stops(fired):
        os.kill(os.getpid(), signal.SIGSTOP)  # returns once continued
        return
    try:
        os.kill(os.getpid(), signal.SIGKILL)
    finally:
        # SIGKILL cannot be caught; this only runs where it is unavailable.
        os._exit(137)
