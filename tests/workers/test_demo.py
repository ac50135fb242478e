"""`deltasync demo` as a user runs it: embedded Redis, local folder store."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.pipeline_helpers import cli

pytestmark = pytest.mark.slow


def _demo_rows(stderr: str) -> dict[int, list[str]]:
    """The demo table's rows by version: its cells, stripped."""
    rows = {}
    for line in stderr.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if len(cells) == 9 and cells[0].isdigit():
            rows[int(cells[0])] = cells
    return rows


def _report_synced(page: str) -> dict[int, str]:
    """`deltasync report --html`'s synced column by version."""
    out = {}
    for row in re.findall(r"<tr>(<td>.*?)</tr>", page):
        cells = re.findall(r"<td>(.*?)</td>", row)
        out[int(cells[0])] = cells[7]
    return out


def test_demo_replicas_bit_exact_with_compaction(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTASYNC_")}
    env["DELTASYNC_HOME"] = str(tmp_path / "home")
    env.pop("COLUMNS", None)  # not a terminal: the table must still be whole
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
        page = tmp_path / "run.html"
        report = cli(env, "report", "--run", "ci-demo", "--html", "--out", str(page))
    finally:
        stopped = cli(env, "redis", "stop")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert text.count("bit-identical to the trainer's") == 2, text[-4000:]
    assert "compaction: anchor at version" in text
    assert "every replica matched the trainer bit for bit" in text
    assert "codec kernels ready in" in text  # compiled before the clock, and said so
    # The summary's title starts a line of its own after the live view's last frame.
    titles = [line for line in out.stderr.splitlines() if "ci-demo: per version" in line]
    assert len(titles) == 1 and titles[0].strip().startswith("run ci-demo"), titles
    assert "…" not in out.stderr, "a cell was cut"
    # The live table names the replicas (its last frame, printed off a terminal).
    assert re.search(r"│ replica-0 +│ 7 +│ 0 +│ done", out.stderr), out.stderr[-4000:]
    rows = _demo_rows(out.stderr)
    assert sorted(rows) == list(range(8)), rows
    assert any("catch-up: replica-1" in cells[8] for cells in rows.values())  # the late joiner
    # `deltasync report` gives the same sync times (same definitions, same events).
    assert report.returncode == 0, report.stderr[-2000:]
    synced = _report_synced(page.read_text())
    for version, cells in rows.items():
        if cells[6] == "-":
            assert synced[version] == "-", version
        else:
            assert abs(float(cells[6]) - float(synced[version])) < 0.006, version
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert (tmp_path / "home" / "store" / "ci-demo" / "anchors").is_dir()
