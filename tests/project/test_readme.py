"""The README's code blocks run, in order, as a reader would run them.

Python blocks run in one namespace (a later block may use an earlier one's names);
shell blocks run line by line through bash. Every process sees one test Redis and a
fresh ``DELTASYNC_HOME``, so the store and staging folder are local folders. A block
that cannot run here says why: an HTML comment ``<!-- not run: REASON -->`` on the
line before it, or an entry in ``NOT_RUN`` for a block that must stay where it is.
A ```text block is a picture, not code.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"

# Blocks that cannot carry a comment before them, by their first line.
NOT_RUN = {
    "scripts/demo.sh": "the quick start: the whole demo takes minutes, and "
    "scripts/test.sh runs the whole suite (CI runs it as such)",
}

_FENCE = re.compile(r"^```(\w*)\s*$")
_REASON = re.compile(r"^<!--\s*not run:\s*(.+?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    reason: str | None  # why it does not run; None: it runs


def readme_blocks(text: str) -> list[Block]:
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        start = i
        end = start + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        code = "\n".join(lines[start + 1 : end]) + "\n"
        before = lines[start - 1] if start > 0 else ""
        tag = _REASON.match(before)
        first = code.lstrip().splitlines()[0] if code.strip() else ""
        reason = tag.group(1) if tag else NOT_RUN.get(first.split()[0] if first else "")
        blocks.append(Block(start + 1, match.group(1), code, reason))
        i = end + 1
    return blocks


def test_every_block_runs_or_says_why_not() -> None:
    """A block in a language this test cannot run, with no reason given, fails."""
    for block in readme_blocks(README.read_text()):
        if block.reason is None and block.lang != "text":
            assert block.lang in ("python", "sh"), (
                f"README.md line {block.line}: a ```{block.lang} block neither runs here "
                "nor says why not (<!-- not run: REASON --> before it)"
            )


def test_the_reasons_name_something() -> None:
    for block in readme_blocks(README.read_text()):
        if block.reason is not None:
            assert len(block.reason) > 10, f"README.md line {block.line}: say why it cannot run"


def test_the_blocks_run_in_order(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The training loop emits to a test Redis, a burst diff worker publishes, a node
    in this process follows the run bit for bit, and the operator's commands answer."""
    home = tmp_path / "home"
    env = {
        "DELTASYNC_HOME": str(home),
        "DELTASYNC_REDIS_URL": redis_url,
        "DELTASYNC_LOG_JSON": "true",
        "DELTASYNC_WARM": "false",  # the kernels are compiled on first use
    }
    for name in [n for n in os.environ if n.startswith("DELTASYNC_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)

    namespace: dict[str, object] = {"__name__": "readme"}
    ran = 0
    for block in readme_blocks(README.read_text()):
        if block.reason is not None or block.lang == "text":
            continue
        where = f"README.md line {block.line}"
        if block.lang == "python":
            exec(compile(block.code, where, "exec"), namespace)
        else:
            done = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", block.code],
                env=dict(os.environ),
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            assert done.returncode == 0, f"{where}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        ran += 1
    assert ran >= 4, "the README should keep runnable examples"
