"""No import circle inside ``outboxkit``: module-level and function-level imports alike.

The graph is read from the source (every ``import`` and ``from ... import`` at any depth, the
ones under ``if TYPE_CHECKING:`` aside, which never run). A module importing a name from a
package points at the package's ``__init__``, or at the submodule when the name is one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import outboxkit

ROOT = Path(outboxkit.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _resolve(name: str) -> str | None:
    """The module of ``outboxkit`` that importing ``name`` runs, or None (outside)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def edges(module: str, source: str) -> set[str]:
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in _imports(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            if node.level:
                base = package.split(".")
                if node.level > 1:
                    base = base[: -(node.level - 1)]
                prefix = ".".join([*base, node.module] if node.module else base)
            else:
                prefix = node.module or ""
            # "from pkg import sub" imports the submodule; "from mod import name" the module.
            names = [
                f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in MODULES else prefix
                for alias in node.names
            ]
        for name in names:
            target = _resolve(name)
            if target is not None and target != module:
                targets.add(target)
    return targets


def import_graph() -> dict[str, set[str]]:
    return {m: edges(m, p.read_text(encoding="utf-8")) for m, p in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_there_is_no_import_circle_in_outboxkit() -> None:
    graph = import_graph()
    assert len(graph) > 30  # the whole package was read
    assert "outboxkit.core.machine" in graph["outboxkit.poller"]
    assert cycles(graph) == []


@pytest.mark.parametrize(
    ("sources", "circle"),
    [
        ({"outboxkit.a": "from . import b", "outboxkit.b": "import outboxkit.a"}, True),
        (
            {"outboxkit.a": "def f():\n    from .b import x", "outboxkit.b": "from .a import y"},
            True,
        ),
        (
            {
                "outboxkit.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import x",
                "outboxkit.b": "from .a import y",
            },
            False,
        ),
        ({"outboxkit.a": "from .b import x", "outboxkit.b": "import json"}, False),
    ],
    ids=["module-level", "function-level", "type-only", "none"],
)
def test_the_check_finds_circles(
    monkeypatch: pytest.MonkeyPatch, sources: dict[str, str], circle: bool
) -> None:
    monkeypatch.setattr(
        "tests.unit.test_imports.MODULES", {m: ROOT / f"{m.split('.')[-1]}.py" for m in sources}
    )
    graph = {m: edges(m, s) for m, s in sources.items()}
    assert bool(cycles(graph)) is circle
