"""The README's promises that code can check."""

from __future__ import annotations

from pathlib import Path

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
