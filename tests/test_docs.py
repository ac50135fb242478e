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
