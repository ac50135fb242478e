"""The README's promises that code can check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import configuration_reference

REPO = Path(__file__).resolve().parent.parent


def test_readme_starts_with_the_two_commands() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert lines[0] == "```sh"
    assert lines[1].startswith("scripts/demo.sh")
    assert lines[2].startswith("scripts/test.sh")
    ci = (REPO / ".ci" / "run").read_text()
    assert "scripts/test.sh" in ci.split("\n#")[0] or "\nscripts/test.sh" in ci


def test_readme_configuration_reference_is_current() -> None:
    assert configuration_reference().strip() in (REPO / "README.md").read_text()


def test_readme_has_no_unfilled_placeholders() -> None:
    text = (REPO / "README.md").read_text()
    for placeholder in ("PERFORMANCE_SUMMARY", "CONFIG_TABLE", "LIMITATIONS"):
        assert placeholder not in text


def test_architecture_names_every_module_and_only_modules_that_exist() -> None:
    """docs/ARCHITECTURE.md is the map: every module of pipeline/ and workers/ is on
    it by its path, and every path on it exists."""
    import re

    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"`((?:pipeline|workers)/[\w/]+\.py)`", text))
    modules = {
        str(p.relative_to(REPO))
        for package in ("pipeline", "workers")
        for p in (REPO / package).rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    }
    assert sorted(modules - named) == [], "modules missing from docs/ARCHITECTURE.md"
    assert sorted(named - modules) == [], "docs/ARCHITECTURE.md names modules that do not exist"


def test_format_spec_exists_is_linked_and_stays_a_page() -> None:
    """docs/FORMAT.md, the on-store format an independent reader is written from
    (tests/test_format_spec.py), is one page that the README points to."""
    lines = (REPO / "docs" / "FORMAT.md").read_text().splitlines()
    assert lines[0] == "# deltasync store format"
    assert len(lines) < 500
    assert "](docs/FORMAT.md)" in (REPO / "README.md").read_text()


BENCHMARKS = sorted(
    p.name
    for p in (REPO / "benchmarks").glob("*.py")
    if p.name.startswith(("bench_", "reliability"))
)


@pytest.mark.parametrize("script", BENCHMARKS)
def test_every_benchmark_answers_help_from_any_folder(script: str, tmp_path: Path) -> None:
    """docs/PERFORMANCE.md quotes each benchmark's command line: each one starts from
    another folder with no PYTHONPATH and explains itself."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: "), done.stdout[:500]
