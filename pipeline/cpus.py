"""How many CPUs this process may really use.

``os.cpu_count()`` counts the machine's CPUs. A container limited with
``--cpus`` or a process pinned with ``taskset`` may use fewer, and thread pools
sized from the machine's count then oversubscribe what they have.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def usable_cpus(cgroup_root: Path = CGROUP_ROOT) -> int:
    """The smallest of the affinity mask and the cgroup's CPU quota (v2 or v1), at least 1."""
    counts = [_affinity()]
    quota = _cgroup_quota(cgroup_root)
    if quota is not None:
        counts.append(quota)
    return max(1, min(counts))


@functools.cache
def available() -> int:
    """``usable_cpus()`` of this process, read once."""
    return usable_cpus()


def _affinity() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _cgroup_quota(root: Path) -> int | None:
    """CPUs the cgroup's bandwidth limit allows (rounded up), None when unlimited."""
    v2 = _read(root / "cpu.max")
    if v2 is not None:
        fields = v2.split()
        if len(fields) == 2 and fields[0] != "max":
            return _ratio(fields[0], fields[1])
        return None
    quota = _read(root / "cpu" / "cpu.cfs_quota_us") or _read(root / "cpu.cfs_quota_us")
    period = _read(root / "cpu" / "cpu.cfs_period_us") or _read(root / "cpu.cfs_period_us")
    if quota is None or period is None:
        return None
    return _ratio(quota, period)


def _ratio(quota: str, period: str) -> int | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    if q <= 0 or p <= 0:  # -1: no limit
        return None
    return max(1, math.ceil(q / p))


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
