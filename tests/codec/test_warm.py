"""Kernel warm-up: after it, publishing and applying a version compile nothing."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from pipeline.codec import encode_delta, read_delta
from pipeline.config import Settings
from pipeline.logs import clear_context, configure_logging
from tests.pipeline_helpers import REPO
from workers import warm

# In a process of its own (this one may have compiled anything already): warm up, then
# publish and apply a run the warm-up never saw, counting numba's compilations.
_AFTER_WARM = """
import json, sys, tempfile, time
from pathlib import Path
import torch
from numba.core import event
from workers import warm
from workers.warm import run_once

if sys.argv[1] == "warm":
    warm.warm()
compiled = []

class Count(event.Listener):
    def on_start(self, ev):
        compiled.append(str(ev.data["dispatcher"].py_func.__qualname__))
    def on_end(self, ev):
        pass

event.register("numba:compile", Count())
# Another run: other contents and sizes, a bigger model, the same paths.
original = warm.synthetic_states
def bigger(count, dtype=torch.bfloat16):
    states = original(count, dtype)
    g = torch.Generator().manual_seed(5)
    extra = (0.02 * torch.randn(3000, 700, generator=g)).to(dtype)
    out = []
    for k, s in enumerate(states):
        t = extra.clone()
        t.view(torch.int16).view(-1)[k :: 53] += 1
        out.append({**s, "model.extra.weight": t})
    return out
warm.synthetic_states = bigger
with tempfile.TemporaryDirectory() as folder:
    run_once(Path(folder), [1])
print(json.dumps(compiled))
"""


def _compiled_by_a_run(cache: Path, first: str) -> list[str]:
    """The kernels a run compiled in a new process with the empty kernel cache
    ``cache``, after ``first`` ("warm": the warm-up; else nothing)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NUMBA_CACHE_DIR", "DELTASYNC_KERNEL_CACHE")
    }
    env["XDG_CACHE_HOME"] = str(cache)
    done = subprocess.run(
        [sys.executable, "-c", _AFTER_WARM, first],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    )
    compiled: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return compiled


@pytest.mark.slow
def test_after_the_warm_up_a_run_compiles_nothing(tmp_path: Path) -> None:
    assert _compiled_by_a_run(tmp_path / "warmed", "warm") == []
    # Without it, the same run compiles the kernels (so the count above can fail).
    assert "walk_records" in _compiled_by_a_run(tmp_path / "cold", "none")


def test_the_synthetic_run_uses_every_encoding() -> None:
    states = warm.synthetic_states(2)
    delta = read_delta(encode_delta([(n, states[0][n], states[1][n]) for n in states[0]], 1))
    encodings = {info.name: info.encoding for info in delta.tensors}
    assert set(encodings.values()) == {"sparse", "bitmap", "dense", "same"}
    changed = {info.name: info.changed for info in delta.tensors}
    assert changed["embed.weight"] > warm.SMALL_CHANGES  # proven alone, not in a batch
    assert 0 < changed["layer.q.weight"] < warm.SMALL_CHANGES


@pytest.fixture
def json_logs() -> Iterator[io.StringIO]:
    out = io.StringIO()
    configure_logging("debug", json=True, stream=out)
    try:
        yield out
    finally:
        clear_context()
        structlog.reset_defaults()


def test_a_background_warm_up_logs_one_line(json_logs: io.StringIO) -> None:
    thread = warm.in_background(Settings.from_env())
    thread.join(timeout=900)
    assert not thread.is_alive()
    events = [json.loads(line)["event"] for line in json_logs.getvalue().splitlines()]
    # The warm-up's own run (published, bootstrapped, applied) is not in the log.
    assert events == ["kernels ready"]
