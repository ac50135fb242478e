"""Helpers for tests that run real deltasync processes (workers, CLI)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def deltasync_env(redis_url: str, tmp: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "DELTASYNC_REDIS_URL": redis_url,
            "DELTASYNC_STORE": f"file://{tmp / 'store'}",
            "DELTASYNC_HOME": str(tmp / "home"),
            "DELTASYNC_LOG_JSON": "1",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO),
            # Background scrubs (nodes, diff workers) only where a test turns them on.
            "DELTASYNC_SCRUB_MINUTES": "0",
            # Kernel warm-ups at start (nodes, diff workers) only where a test turns them on.
            "DELTASYNC_WARM": "0",
        }
    )
    env.update(extra)
    return env


def cli(
    env: Mapping[str, str], *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run the real `deltasync` command line in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "workers", *args],
        env=dict(env),
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


@contextmanager
def processes(
    env: Mapping[str, str], log_dir: Path, **commands: list[str]
) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """Start `deltasync <args>` processes (name -> args); stop them all on exit."""
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, args in commands.items():
            out = (log_dir / f"{name}.log").open("ab")
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "workers", *args],
                env=dict(env),
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The integer view used for bitwise comparison (float == ignores NaN payloads and -0.0)."""
    t = t.contiguous().reshape(-1)
    return t.view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    )


def assert_same_state(
    actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], what: str
) -> None:
    assert list(actual) == list(expected) or set(actual) == set(expected), what
    for name, tensor in expected.items():
        got = actual[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, f"{what}: {name}"
        differ = int((bits(got) != bits(tensor)).sum())
        assert differ == 0, f"{what}: {name} differs in {differ} elements"
