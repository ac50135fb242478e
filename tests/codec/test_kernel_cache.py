"""The kernels' disk cache: a folder of the user's, keyed by every kernel source, that a
new process (or virtual environment) loads instead of compiling again."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import kernel_cache
from pipeline.config import Settings
from pipeline.errors import ConfigError
from tests.pipeline_helpers import REPO

PIPELINE = REPO / "pipeline"


def test_the_folder_by_setting() -> None:
    home = str(Path.home())
    assert kernel_cache.folder({}, "") == Path(home) / ".cache" / "deltasync" / "kernels"
    assert kernel_cache.folder({"XDG_CACHE_HOME": "/x"}, "") == Path("/x/deltasync/kernels")
    assert kernel_cache.folder({}, "/k") == Path("/k")
    assert kernel_cache.folder({}, " off ") is None
    # NUMBA_CACHE_DIR (the images, the bounds-checked test run) keeps numba's own cache.
    assert kernel_cache.folder({"NUMBA_CACHE_DIR": "/n"}, "/k") is None
    assert Settings.from_env({"DELTASYNC_KERNEL_CACHE": "/k"}).kernel_cache == "/k"


def test_the_choice_comes_before_the_first_kernel() -> None:
    # This process has imported kernels (other tests ran): choosing again is refused,
    # choosing what holds is not.
    from pipeline.format.hashes import mixsum

    assert mixsum.compiled() is not None
    kernel_cache.choose(kernel_cache._chosen)
    with pytest.raises(ConfigError, match="before the first kernel"):
        kernel_cache.choose("/somewhere/else")


def _pipeline_imports(path: Path) -> set[str]:
    """Files under pipeline/ that ``path`` imports (``from pipeline.x import y`` and
    ``from pipeline import x``), relative to pipeline/."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("pipeline"):
            continue
        assert node.module is not None
        modules = [node.module] if node.module != "pipeline" else []
        modules += [f"{node.module}.{a.name}" for a in node.names if node.module == "pipeline"]
        for module in modules:
            relative = Path(*module.split(".")[1:])
            for candidate in (relative.with_suffix(".py"), relative / "__init__.py"):
                if (PIPELINE / candidate).exists():
                    found.add(candidate.as_posix())
    return found


def test_every_source_a_kernel_compiles_from_is_in_the_key() -> None:
    kernel_modules = {
        p.relative_to(PIPELINE).as_posix()
        for p in PIPELINE.rglob("*.py")
        if "kernel_cache.jit" in p.read_text()
    }
    assert kernel_modules, "no module compiles through the kernel cache"
    assert kernel_modules <= set(kernel_cache.KERNEL_SOURCES)
    for module in kernel_modules:
        # kernel_cache itself holds no kernel code; everything else they import may.
        imported = _pipeline_imports(PIPELINE / module) - {"kernel_cache.py"}
        missing = imported - set(kernel_cache.KERNEL_SOURCES)
        assert not missing, f"{module} compiles code from {sorted(missing)}, not in the key"


def test_the_key_changes_with_any_kernel_source(tmp_path: Path) -> None:
    copy = tmp_path / "pipeline"
    for name in kernel_cache.KERNEL_SOURCES:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(PIPELINE / name, copy / name)
    assert kernel_cache.digest(copy) == kernel_cache.digest()
    constants = copy / "codec/compiled/fused_constants.py"
    constants.write_text(constants.read_text() + "\n# a change\n")
    assert kernel_cache.digest(copy) != kernel_cache.digest()


_HASH_ONCE = """
import json, torch
from pipeline.format.hashes import mixsum
digest = mixsum.full(torch.arange(1000, dtype=torch.int16))
stats = mixsum.compiled().full_sum.stats
print(json.dumps({"digest": digest, "hits": sum(stats.cache_hits.values()),
                  "misses": sum(stats.cache_misses.values()), "path": stats.cache_path}))
"""


def _hash_in_a_new_process(cache: Path, source: Path = REPO) -> dict[str, object]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NUMBA_CACHE_DIR", "DELTASYNC_KERNEL_CACHE")
    }
    env.update({"XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(source)})
    done = subprocess.run(
        [sys.executable, "-c", _HASH_ONCE],
        env=env,
        cwd=source,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    found: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


@pytest.mark.slow
def test_a_new_process_and_a_copy_of_the_sources_load_what_one_compiled(tmp_path: Path) -> None:
    cache = tmp_path / "user-cache"  # XDG_CACHE_HOME: no setting needed
    first = _hash_in_a_new_process(cache)
    assert first["misses"] == 1 and first["hits"] == 0  # compiled, then saved
    assert str(first["path"]) == str(cache / "deltasync" / "kernels" / kernel_cache.digest())
    again = _hash_in_a_new_process(cache)
    assert again["hits"] == 1 and again["misses"] == 0  # loaded, not compiled
    # Another copy of the package (a new virtual environment, files of other mtimes)
    # with the same kernel sources loads them too.
    copy = tmp_path / "other-env"
    shutil.copytree(PIPELINE, copy / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    elsewhere = _hash_in_a_new_process(cache, copy)
    assert elsewhere["hits"] == 1 and elsewhere["misses"] == 0
    assert first["digest"] == again["digest"] == elsewhere["digest"]
