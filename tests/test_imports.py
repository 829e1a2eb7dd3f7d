"""No import cycles among cbgen's modules, counting imports inside functions too (an import moved
into a function hides a cycle, it does not remove it), and every module imports on its own in a
fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cbgen"


def module_names() -> dict[str, Path]:
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement under node, leaving out the bodies of `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            found.append(child)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                found.extend(_imports(ast.Module(body=[other], type_ignores=[])))
        else:
            found.extend(_imports(child))
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the cbgen modules it imports, anywhere in its code. `from pkg import name`
    points at pkg.name when that is a module, else at pkg (its __init__)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for imp in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(imp, ast.Import):
                targets = [a.name for a in imp.names]
            else:
                base = imp.module or ""
                if imp.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (imp.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in imp.names
                ]
            edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_graph_finds_the_cycles_it_should() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "import x.y\n"
        "if TYPE_CHECKING:\n    import hidden\nelse:\n    import shown\n"
        "def f():\n    from z import w\n"
    )
    names = [a.name for imp in _imports(tree) for a in imp.names]
    assert names == ["TYPE_CHECKING", "x.y", "shown", "w"]


def test_cbgen_has_no_import_cycle() -> None:
    modules = module_names()
    graph = import_graph(modules)
    assert "cbgen.engine.engine" in graph["cbgen.llm"]  # the walk sees the package
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_every_module_imports_on_its_own() -> None:
    """Each module first in a fresh set of cbgen modules (torch and the rest stay loaded, so
    this takes seconds, not one interpreter per module)."""
    code = (
        "import importlib, sys\n"
        "failed = []\n"
        f"for name in {sorted(module_names())!r}:\n"
        "    for loaded in [m for m in sys.modules if m == 'cbgen' or m.startswith('cbgen.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as e:\n"
        "        failed.append(f'{name}: {type(e).__name__}: {e}')\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ---- which package may import which --------------------------------------------------------

ALLOWED: dict[str, set[str]] = {
    # start-up phases: announced where the work is done (the kernel build), heard by the run
    "cbgen.phases": set(),
    # the kernel layers: tensors in, tensors out; they know no model, backend or engine
    "cbgen.cpu": {"cbgen.phases"},
    "cbgen.config": set(),
    "cbgen.metrics": set(),
    "cbgen.display": {"cbgen.config", "cbgen.metrics"},
    "cbgen.attention": {"cbgen.config", "cbgen.cpu"},
    # models are neutral: they run on whatever ops and linear methods a runtime gives them
    "cbgen.models": {"cbgen.attention", "cbgen.config"},
    # the one place that binds a model to a device's kernels
    "cbgen.runtime": {"cbgen.attention", "cbgen.config", "cbgen.cpu", "cbgen.models"},
    "cbgen.engine": {
        "cbgen.attention",
        "cbgen.config",
        "cbgen.metrics",
        "cbgen.models",
        "cbgen.phases",
        "cbgen.runtime",
    },
    "cbgen.llm": {"cbgen.config", "cbgen.engine", "cbgen.metrics"},
    # a run and the benchmarks report the machine (cbgen.cpu.features), nothing else of it
    "cbgen.io": {
        "cbgen",
        "cbgen.config",
        "cbgen.cpu.features",
        "cbgen.display",
        "cbgen.engine",
        "cbgen.metrics",
        "cbgen.models",
        "cbgen.phases",
    },
    "cbgen.bench": {
        "cbgen.cli_options",
        "cbgen.config",
        "cbgen.cpu.features",
        "cbgen.engine",
        "cbgen.metrics",
        "cbgen.models",
    },
    # a run's engines on a Ray cluster, fed by the run's own reader and writer
    "cbgen.ray": {"cbgen.config", "cbgen.display", "cbgen.engine", "cbgen.io", "cbgen.phases"},
    "cbgen.cli_options": {"cbgen.config"},
    "cbgen.run_options": {"cbgen.io", "cbgen.ray"},
    "cbgen.run_command": {
        "cbgen.cli_options",
        "cbgen.run_options",
        "cbgen.config",
        "cbgen.display",
        "cbgen.io",
        "cbgen.ray",
    },
    "cbgen.cli": {"cbgen", "cbgen.bench", "cbgen.models", "cbgen.run_command", "cbgen.run_options"},
    "cbgen": {"cbgen.config", "cbgen.llm"},
}
"""Package (or top-level module) -> the cbgen packages and modules it may import, anywhere in
its code, functions included (docs/DESIGN.md draws it). A package always imports itself."""


OPTIONS = ("cbgen.config", "cbgen.sampling_params", "cbgen.option_checks")
"""The options layer, "cbgen.config" in ALLOWED: an engine's options, a request's, and the
checks both go through."""


def _layer(module: str) -> str:
    return "cbgen.config" if module in OPTIONS else module


def _owner(module: str) -> str:
    """The ALLOWED key a module belongs to: the longest that is it or a package above it."""
    module = _layer(module)
    keys = [k for k in ALLOWED if _within(module, k)]
    return max(keys, key=len)


def _within(module: str, key: str) -> bool:
    """module is key or inside it (the package cbgen itself counts as its __init__ alone)."""
    return module == key or (key != "cbgen" and module.startswith(key + "."))


def _allowed(source: str, target: str) -> bool:
    owner, target = _owner(source), _layer(target)
    return _within(target, owner) or any(_within(target, a) for a in ALLOWED[owner])


def test_each_package_imports_only_what_the_layering_allows() -> None:
    graph = import_graph(module_names())
    wrong = sorted(
        f"{source} imports {target}"
        for source, targets in graph.items()
        for target in targets
        if not _allowed(source, target)
    )
    assert wrong == []
    assert all(_owner(m) for m in graph)  # every module has a row


def test_the_layering_check_sees_a_forbidden_import() -> None:
    assert not _allowed("cbgen.cpu.kernels", "cbgen.models.base")
    assert not _allowed("cbgen.models.llama", "cbgen.cpu.kernels")
    assert not _allowed("cbgen.engine.engine", "cbgen.cpu.tuning")
    assert not _allowed("cbgen.io.summary", "cbgen.cpu.kernels")
    assert _allowed("cbgen.io.summary", "cbgen.cpu.features")
    assert _allowed("cbgen.runtime.cpu", "cbgen.cpu.kernels")
    assert _allowed("cbgen.cpu.kernels", "cbgen.cpu.build")
    assert _allowed("cbgen.models.base", "cbgen.sampling_params")
    assert not _allowed("cbgen.sampling_params", "cbgen.engine.engine")


# ---- the tests themselves ------------------------------------------------------------------


def test_no_test_module_imports_another_or_conftest() -> None:
    """What test modules share lives in tests/helpers (fixtures in conftest.py, which pytest
    hands out by name): importing another test module runs its module-level code and ties the
    two files' layouts together."""
    tests = ROOT / "tests"
    modules = {p.stem for p in tests.rglob("test_*.py")} | {"conftest"}
    wrong = []
    for path in sorted(tests.rglob("*.py")):
        for imp in _imports(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in imp.names] if isinstance(imp, ast.Import) else [imp.module]
            wrong += [f"{path.relative_to(ROOT)}: {n}" for n in names if n in modules]
    assert wrong == []
