"""Crash points for fault-injection tests.

Code calls ``point("publish.before_manifest")`` at places where a crash must
leave a consistent store. Nothing happens unless the environment variable
``DELTASYNC_FAULT`` names that point; then the process kills itself with
SIGKILL, exactly as an out-of-memory kill or a pulled plug would, without
running ``finally`` blocks or atexit handlers.
"""

from __future__ import annotations

import os
import signal

FAULT_ENV = "DELTASYNC_FAULT"


def point(name: str) -> None:
    """Die here, abruptly, when ``DELTASYNC_FAULT`` equals ``name``."""
    if os.environ.get(FAULT_ENV) != name:
        return
    try:
        os.kill(os.getpid(), signal.SIGKILL)
    finally:
        # SIGKILL cannot be caught; this only runs where it is unavailable.
        os._exit(137)
