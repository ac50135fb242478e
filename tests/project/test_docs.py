"""The docs' promises that code can check: the README's opening commands, the
settings, commands, paths and modules the docs name, and the benchmarks they quote."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import click
import pytest

from pipeline.config import PROCESS_VARIABLES, Settings, configuration_reference

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_readme_starts_with_the_two_commands() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert lines[0] == "```sh"
    assert lines[1].startswith("scripts/demo.sh")
    assert lines[2].startswith("scripts/test.sh")
    ci = (REPO / ".ci" / "run").read_text()
    assert "scripts/test.sh" in ci.split("\n#")[0] or "\nscripts/test.sh" in ci


def test_readme_has_no_unfilled_placeholders() -> None:
    text = (REPO / "README.md").read_text()
    for placeholder in ("PERFORMANCE_SUMMARY", "CONFIG_TABLE", "LIMITATIONS"):
        assert placeholder not in text


def _settings() -> dict[str, str]:
    """Every ``DELTASYNC_*`` setting with its documented default."""
    return {f.metadata["env"]: f.metadata["default"] for f in fields(Settings)}


def test_deploy_holds_the_whole_configuration_reference() -> None:
    """docs/DEPLOY.md carries the table generated from the settings, as it is now."""
    assert configuration_reference().strip() in (REPO / "docs" / "DEPLOY.md").read_text()


def test_readme_settings_table_matches_the_code() -> None:
    """The README's short table: each row a real setting, with its real default."""
    settings = _settings()
    text = (REPO / "README.md").read_text()
    rows = re.findall(r"^\| `(DELTASYNC_\w+)` \| `([^`]*)` \|", text, re.M)
    assert len(rows) >= 8
    for name, default in rows:
        assert name in settings, f"README.md names a setting that does not exist: {name}"
        assert default == settings[name], f"README.md: {name} defaults to {settings[name]!r}"


_VARIABLE = re.compile(r"DELTASYNC_[A-Z0-9_]*[A-Z0-9]")


def _known_variables() -> set[str]:
    """Names the code, the images, the scripts or the tests read."""
    known = set(_settings()) | set(PROCESS_VARIABLES)
    sources = [REPO / "compose.yaml", *(REPO / "docker").rglob("*"), *(REPO / "scripts").glob("*")]
    for package in ("pipeline", "workers", "tests", "benchmarks"):
        sources += (REPO / package).rglob("*.py")
    for source in sources:
        if source.is_file():
            known |= set(_VARIABLE.findall(source.read_text(errors="ignore")))
    return known


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_variable_a_doc_names_exists(doc: Path) -> None:
    named = set(_VARIABLE.findall(doc.read_text()))
    assert sorted(named - _known_variables()) == [], f"{doc.name} names variables nothing reads"


# `deltasync/` is left out: the front door is one file, and `deltasync/staleness` is a metric.
_TOP = "pipeline|workers|tests|benchmarks|scripts|docker|examples|docs"
_PATH = re.compile(rf"(?<![\w./-])((?:{_TOP})/[\w./*-]*[\w/*])")
_DOTTED = re.compile(r"(?<![\w./])((?:pipeline|workers)(?:\.\w+)+)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_and_module_a_doc_names_exists(doc: Path) -> None:
    """Files and folders named by path (`pipeline/publish/diff.py`) exist. A dotted
    name (`pipeline.rollout.node.RolloutNode`) names a module, and the name after the
    module appears in its source."""
    text = doc.read_text()
    paths = {path.rstrip("./") for path in _PATH.findall(text)}
    missing = sorted(
        path
        for path in paths
        if not ((REPO / path).exists() or ("*" in path and any(REPO.glob(path))))
    )
    assert missing == [], f"{doc.name} names paths that do not exist"
    for dotted in sorted(set(_DOTTED.findall(text))):
        parts = dotted.split(".")
        source: Path | None = None
        cut = len(parts)
        while cut > 1 and source is None:
            base = REPO.joinpath(*parts[:cut])
            if base.with_suffix(".py").is_file():
                source = base.with_suffix(".py")
            elif (base / "__init__.py").is_file():
                source = base / "__init__.py"
            else:
                cut -= 1
        assert source is not None, f"{doc.name}: {dotted} names no module"
        for attr in parts[cut : cut + 1]:
            assert re.search(rf"\b{attr}\b", source.read_text()), (
                f"{doc.name}: {dotted}: {source.relative_to(REPO)} has no {attr}"
            )


def _cli_commands() -> dict[str, set[str]]:
    """Each command path ("", "status", "redis url") with its options."""
    from workers.cli.main import cli

    commands: dict[str, set[str]] = {}

    def walk(prefix: str, command: click.Command) -> None:
        commands[prefix] = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                walk(f"{prefix} {name}".strip(), sub)

    walk("", cli)
    return commands


_GLOBAL_WITH_VALUE = {"--redis-url", "--store", "--home", "--log-level"}
_WORD = re.compile(r"[a-z][a-z-]*")


def _command_lines(text: str) -> list[str]:
    """What follows `deltasync ` in code: inline spans and lines of fenced blocks."""
    fenced = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    lines = spans + [line for block in fenced for line in block.splitlines()]
    found = []
    for line in lines:
        for match in re.finditer(r"(?:^|[\s$(])deltasync((?: [^\s#|;&)`]+)+)", line):
            found.append(match.group(1).strip())
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_command_a_doc_names_exists(doc: Path) -> None:
    """`deltasync COMMAND [SUB] --option` in the docs' code names a real command with
    real options (`serve` hands unknown options to vLLM: its are not checked)."""
    commands = _cli_commands()
    for words in _command_lines(doc.read_text()):
        tokens = words.split()
        path: list[str] = []
        i = 0
        while i < len(tokens):
            token = tokens[i]
            if token.startswith("-") and not path:
                global_options = commands[""] | {"--help", "-h"}
                assert token.split("=")[0] in global_options, f"{doc.name}: deltasync {words}"
                i += 2 if token in _GLOBAL_WITH_VALUE else 1
            elif _WORD.fullmatch(token) and " ".join([*path, token]) in commands:
                path.append(token)
                i += 1
            else:
                break
        if not path:
            assert i == len(tokens) or not _WORD.fullmatch(tokens[i]), (
                f"{doc.name}: `deltasync {words}` names no command"
            )
            continue
        if path[0] == "serve":
            continue
        command = " ".join(path)
        for token in tokens[i:]:
            option = token.split("=")[0]
            if re.fullmatch(r"--[a-z][a-z-]*", option):
                assert option in commands[command] | {"--help"}, (
                    f"{doc.name}: `deltasync {words}`: `{command}` has no {option}"
                )


def test_format_spec_exists_is_linked_and_stays_a_page() -> None:
    """docs/FORMAT.md, the on-store format an independent reader is written from
    (tests/format/test_format_spec.py), is one page that the README points to."""
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
