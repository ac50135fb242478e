"""`deltasync demo` as a user runs it: embedded Redis, local folder store."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.pipeline_helpers import cli

pytestmark = pytest.mark.slow


def test_demo_replicas_bit_exact_with_compaction(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTASYNC_")}
    env["DELTASYNC_HOME"] = str(tmp_path / "home")
    env["COLUMNS"] = "160"
    try:
        out = cli(
            env,
            "demo",
            "--steps",
            "8",
            "--model",
            "tiny",
            "--compact-every",
            "3",
            "--replicas",
            "2",
            "--run",
            "ci-demo",
            timeout=900,
        )
    finally:
        stopped = cli(env, "redis", "stop")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert text.count("bit-identical to the trainer's") == 2, text[-4000:]
    assert "compaction: anchor at version" in text
    assert "every replica matched the trainer bit for bit" in text
    # The summary's title starts a line of its own after the live view's last frame.
    titles = [line for line in out.stderr.splitlines() if "ci-demo: per version" in line]
    assert len(titles) == 1 and titles[0].strip().startswith("run ci-demo"), titles
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert (tmp_path / "home" / "store" / "ci-demo" / "anchors").is_dir()
