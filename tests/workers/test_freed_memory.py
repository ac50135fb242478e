"""Torch rollout nodes keep what they free for their next version's buffers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A version's buffers, allocated, written and freed three times: the minor page faults
# of the second and third rounds. Sixteen buffers of 1.5 MiB, 6,144 pages of 4 KiB in
# all: each too small to hold a 2 MiB huge page, which one fault would map.
ROUNDS = """
import resource, sys
import numpy as np
from workers.runtime import keep_freed_memory

print(keep_freed_memory())
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffers = [np.empty(3 << 19, np.uint8) for _ in range(16)]
    for buffer in buffers:
        buffer.fill(1)
    del buffers, buffer
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults[1] + faults[2])
"""

PAGES = 16 * (3 << 19) // 4096


def rounds(**env: str) -> tuple[str, int]:
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"
    }
    out = subprocess.run(
        [sys.executable, "-c", ROUNDS],
        env={**clean, **env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's allocator")
def test_freed_buffers_are_reused_without_faulting_in_again() -> None:
    kept, faults = rounds()
    assert kept == "True"
    assert faults < PAGES // 10, faults


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's allocator")
def test_an_operators_allocator_variables_are_left_alone() -> None:
    # glibc as the operator set it: each round's buffers are mapped afresh and fault in.
    kept, faults = rounds(MALLOC_TRIM_THRESHOLD_="131072")
    assert kept == "False"
    assert faults >= PAGES, faults
    assert rounds(GLIBC_TUNABLES="glibc.malloc.trim_threshold=131072")[0] == "False"
