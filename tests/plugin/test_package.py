"""``outboxkit.testing`` itself: the names it re-exports, one module per role, and an import
graph without cycles (no module imports the package, the pytest plugin stays lazy)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import outboxkit
import outboxkit.testing

PACKAGE = Path(outboxkit.__file__).parent
ROLES = {
    "ANY": "matching",
    "Capture": "capture",
    "CrashAt": "aim",
    "InjectedCrash": "aim",
    "Left": "left",
    "Matcher": "matching",
    "StatementCount": "statements",
    "TestRelay": "relay",
    "TimeMachineClock": "clocks",
    "Drain": "drain",
    "DrainReport": "report",
    "FreezegunClock": "clocks",
    "HandlerErrors": "report",
    "Recorder": "recorder",
    "open_test_store": "stores",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(name: str, *, module_level_only: bool = False) -> set[str]:
    """The outboxkit modules ``name`` imports, at any depth (in functions too), leaving out
    ``if TYPE_CHECKING:`` blocks; ``from pkg import sub`` counts as importing ``pkg.sub``."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit_node(other)
                continue
            visit_node(child)

    def visit_node(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
            else:
                parts = package.split(".")
                if node.level > 1:
                    parts = parts[: -(node.level - 1)]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
            found.update(submodules)
            if len(submodules) < len(node.names):
                found.add(base)
        if module_level_only and isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
        ):
            return
        visit(node)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {m for m in found if m in MODULES and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of an import graph: its strongly connected components of two modules or
    more (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return found


def test_the_package_re_exports_the_public_names_of_its_modules() -> None:
    assert sorted(outboxkit.testing.__all__) == sorted(ROLES)
    for name, role in ROLES.items():
        obj = getattr(outboxkit.testing, name)
        module = importlib.import_module(f"outboxkit.testing.{role}")
        assert obj is getattr(module, name), name
        assert obj.__module__ == module.__name__, name


def test_names_importable_before_the_split_still_are() -> None:
    from outboxkit.testing import (  # noqa: F401
        PAGE,
        Capture,
        Drain,
        DrainReport,
        FreezegunClock,
        HandlerErrors,
        open_test_store,
    )

    assert PAGE == 1000


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("outboxkit.")))
def test_no_module_imports_the_testing_package_itself(module: str) -> None:
    assert "outboxkit.testing" not in imports_of(module)


def test_no_import_cycle_runs_through_the_test_kit() -> None:
    # The whole package's graph, module-level and function-level imports alike: a cycle that
    # leaves the test kit and comes back counts too.
    graph = {m: imports_of(m) for m in MODULES}
    through = [c for c in cycles(graph) if any(m.startswith("outboxkit.testing") for m in c)]
    assert through == []


def test_the_import_graph_sees_every_kind_of_import() -> None:
    # Guards the check above, on the test kit's own modules.
    assert "outboxkit.core.model" in imports_of("outboxkit.testing.report")  # module level
    assert "outboxkit.cli.apps" in imports_of("outboxkit.testing.pytest_plugin")  # in a function
    assert "outboxkit.testing.drain" not in imports_of("outboxkit.testing.capture")  # TYPE_CHECKING
    assert "outboxkit.testing.recorder" in imports_of("outboxkit.testing")  # from . import-style


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_pytest_plugin_imports_nothing_of_outboxkit_at_module_level() -> None:
    assert imports_of("outboxkit.testing.pytest_plugin", module_level_only=True) == set()
