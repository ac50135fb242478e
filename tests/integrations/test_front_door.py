"""`import deltasync`: the front door re-exports the user-facing names, each loaded on
first use, so the import itself loads neither torch nor vLLM; a built wheel holds it."""

from __future__ import annotations

import inspect
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import deltasync
from tests.pipeline_helpers import REPO

HEAVY = ("torch", "vllm", "transformers", "trl", "openai", "numba")


def run_python(code: str, *, cwd: Path, pythonpath: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env={"PYTHONPATH": pythonpath, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_import_deltasync_loads_no_heavy_module(tmp_path: Path) -> None:
    out = run_python(
        "import sys, deltasync; print(sorted(m for m in "
        f"{HEAVY!r} if m in sys.modules)); print(deltasync.__version__)",
        cwd=tmp_path,
        pythonpath=str(REPO),
    )
    assert out.splitlines() == ["[]", deltasync.__version__]


def test_every_name_resolves_and_is_documented() -> None:
    names = [n for n in deltasync.__all__ if n != "__version__"]
    assert sorted(names) == sorted(deltasync._HOMES), "__all__ and the re-exports differ"
    for name in names:
        value = getattr(deltasync, name)
        assert value.__module__ == deltasync._HOMES[name], name
        assert inspect.getdoc(value), f"{name} has no docstring"
        assert name in (deltasync.__doc__ or ""), f"the package doc does not list {name}"
    assert set(deltasync.__all__) <= set(dir(deltasync))
    with pytest.raises(AttributeError, match="has no attribute 'Emiter'"):
        _ = deltasync.Emiter  # type: ignore[attr-defined]


@pytest.mark.slow
def test_a_built_wheel_installs_the_front_door(tmp_path: Path) -> None:
    """``pip install`` of the project gives ``import deltasync; deltasync.Emitter``,
    from outside the source tree."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in ("deltasync", "pipeline", "workers"):
        shutil.copytree(
            REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    wheels = tmp_path / "wheel"
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)]
    subprocess.run(build, check=True, timeout=600)
    wheel = next(wheels.glob("deltasync-*.whl"))
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, timeout=600)  # fmt: skip
    # The installed packages first; the venv's own site-packages give the dependencies.
    out = run_python(
        "import sys, deltasync; e = deltasync.Emitter; print(deltasync.__file__); "
        "print(sys.modules[e.__module__].__file__)",
        cwd=tmp_path,
        pythonpath=str(site),
    )
    front, emitter = out.splitlines()
    assert Path(front).is_relative_to(site) and Path(emitter).is_relative_to(site), out
