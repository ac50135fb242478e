"""Thread pools are sized from the CPUs a process may use, not the machine's count."""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.cpus import usable_cpus


def _affinity() -> int:
    return len(os.sched_getaffinity(0))


def write(root: Path, name: str, text: str) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_a_cgroup_v2_quota_caps_the_count(tmp_path: Path) -> None:
    write(tmp_path, "cpu.max", "50000 100000")  # half a CPU: still one thread
    assert usable_cpus(tmp_path) == 1
    write(tmp_path, "cpu.max", "max 100000")
    assert usable_cpus(tmp_path) == _affinity()


def test_a_cgroup_v1_quota_caps_the_count(tmp_path: Path) -> None:
    write(tmp_path, "cpu/cpu.cfs_quota_us", "100000")
    write(tmp_path, "cpu/cpu.cfs_period_us", "100000")
    assert usable_cpus(tmp_path) == 1
    write(tmp_path, "cpu/cpu.cfs_quota_us", "-1")  # unlimited
    assert usable_cpus(tmp_path) == _affinity()


def test_a_quota_above_the_affinity_mask_leaves_the_mask(tmp_path: Path) -> None:
    write(tmp_path, "cpu.max", f"{(_affinity() + 8) * 100000} 100000")
    assert usable_cpus(tmp_path) == _affinity()


def test_no_cgroup_files_or_garbage_in_them_means_the_affinity_mask(tmp_path: Path) -> None:
    assert usable_cpus(tmp_path) == _affinity()
    write(tmp_path, "cpu.max", "lots of cpus")
    assert usable_cpus(tmp_path) == _affinity()
