"""The code's layout: no import cycle among modules, inside packages too.

``lint-imports`` (pyproject.toml) keeps the packages apart; a cycle between two
modules of one package is below what its contracts see. Here every module-level
import counts, type-only ones included (they tie the modules as tightly for a
reader), and so do modules loaded by name (``importlib.import_module("...")``, how
the compiled kernels are loaded), which grimp does not see.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping

import grimp

from tests.pipeline_helpers import REPO

PACKAGES = ("pipeline", "workers", "deltasync")
MAX_MODULES = 12  # a package a reader takes in at one look; a larger one is split by stage


def _loaded_by_name(module: str, known: set[str]) -> set[str]:
    """Modules of ours that ``module`` loads with ``import_module("<literal>")``."""
    path = REPO.joinpath(*module.split("."))
    source = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    found = set()
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value in known
        ):
            found.add(node.args[0].value)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports."""
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=False)
    known = set(graph.modules)
    return {
        module: (set(graph.find_modules_directly_imported_by(module)) & known)
        | _loaded_by_name(module, known)
        for module in known
    }


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module that
    imports itself), each sorted, by Tarjan's algorithm without recursion."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph.get(node, ()):
                        found.append(sorted(component))
    return sorted(found)


def test_cycles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"d"}}
    assert cycles(graph) == [["a", "b", "c"], ["e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back() -> None:
    found = cycles(import_graph())
    assert found == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_modules_loaded_by_name_count_as_imports() -> None:
    """The kernel modules are loaded by name; their loaders are in the graph."""
    graph = import_graph()
    assert "pipeline.format.hashes.mixsum_jit" in graph["pipeline.format.hashes.mixsum"]
    assert "pipeline.codec.compiled.fused_jit" in graph["pipeline.codec.compiled.fused"]


def test_every_package_holds_at_most_twelve_modules() -> None:
    crowded = {}
    for top in PACKAGES:
        for init in sorted((REPO / top).rglob("__init__.py")):
            modules = sorted(p.name for p in init.parent.glob("*.py"))
            if len(modules) > MAX_MODULES:
                crowded[str(init.parent.relative_to(REPO))] = modules
    assert crowded == {}, f"packages over {MAX_MODULES} modules: {crowded}"
