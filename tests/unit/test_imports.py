"""The import graph of ``outboxkit``, read from the source: no cycle anywhere, and no module of
the command's package imports the package itself.

Every import counts, at module level and inside functions alike (a function-level import only
hides a cycle until the function runs); only those under ``if TYPE_CHECKING:`` are exempt, as
they never run. ``from package import name`` is an edge to ``package.name`` when that is a
module, else to ``package``. The implicit import of a module's parent packages is no edge.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

import outboxkit
import outboxkit.cli

ROOT = Path(outboxkit.__file__).resolve().parent.parent
CLI = "outboxkit.cli"


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of ``outboxkit`` by dotted name: its file, and whether it is a package."""
    found = {}
    for path in sorted((ROOT / "outboxkit").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _imports_in(other)
            continue
        yield from _imports_in(child)


def _imports_in(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    yield from _imports(node)


def _edges(name: str) -> dict[str, int]:
    """The modules of ``outboxkit`` that module ``name`` imports, each with a line number."""
    path, is_package = MODULES[name]
    return _edges_in(path.read_text(encoding="utf-8"), name, is_package, MODULES)


def _edges_in(
    source: str, name: str, is_package: bool, modules: Mapping[str, object]
) -> dict[str, int]:
    base = name if is_package else name.rpartition(".")[0]
    edges: dict[str, int] = {}
    for node in _imports(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                parts = base.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                origin = ".".join([*parts, *([node.module] if node.module else [])])
            else:
                origin = node.module or ""
            targets = [
                f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else origin
                for alias in node.names
            ]
        for target in targets:
            if target in modules:
                edges.setdefault(target, node.lineno)
    return edges


GRAPH = {name: _edges(name) for name in MODULES}


def _cycles(graph: Mapping[str, Mapping[str, int]] = GRAPH) -> list[list[str]]:
    """The strongly connected components with a cycle (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for name in graph:
        if name not in index:
            visit(name)
    return found


def test_the_graph_sees_the_imports() -> None:
    assert len(MODULES) > 30
    assert "outboxkit.cli.runner" in GRAPH["outboxkit.cli.group"]  # module level
    assert "outboxkit.cli.group" in GRAPH[CLI]  # function level
    assert "outboxkit.poller" in GRAPH["outboxkit.cli.runner"]


def test_no_import_cycle_in_outboxkit() -> None:
    listing = [
        ", ".join(f"{v}:{GRAPH[v][w]} -> {w}" for v in cycle for w in GRAPH[v] if w in cycle)
        for cycle in _cycles()
    ]
    assert not listing, "import cycles:\n" + "\n".join(listing)


def test_no_module_of_the_command_imports_its_package() -> None:
    offenders = [
        f"{name}:{edges[CLI]}"
        for name, edges in GRAPH.items()
        if name.startswith(CLI + ".") and CLI in edges
    ]
    assert not offenders, f"import a sibling module instead of {CLI}: {offenders}"


@pytest.mark.parametrize(
    "name", [m.name for m in pkgutil.iter_modules(outboxkit.cli.__path__)], ids=str
)
def test_the_command_package_names_its_modules(name: str) -> None:
    """``outboxkit.cli.<module>`` is the module, not a command of the same name bound over it."""
    module = importlib.import_module(f"{CLI}.{name}")
    assert getattr(outboxkit.cli, name) is module


@pytest.mark.parametrize(
    ("sources", "cycle"),
    [
        ({"outboxkit.a": "from . import b", "outboxkit.b": "import outboxkit.a"}, True),
        (
            {"outboxkit.a": "def f():\n    from .b import x", "outboxkit.b": "from .a import y"},
            True,
        ),
        (
            {
                "outboxkit.a": "import typing\nif typing.TYPE_CHECKING:\n    from .b import x",
                "outboxkit.b": "from .a import y",
            },
            False,
        ),
        ({"outboxkit.a": "from .b import x", "outboxkit.b": "import json"}, False),
    ],
    ids=["module-level", "function-level", "type-only", "none"],
)
def test_the_check_finds_a_cycle(sources: dict[str, str], cycle: bool) -> None:
    graph = {name: _edges_in(text, name, False, sources) for name, text in sources.items()}
    assert bool(_cycles(graph)) is cycle


def test_the_loader_is_light() -> None:
    """``outboxkit.cli.apps`` (the pytest plugin's and the conformance suite's loader) loads
    neither click nor the commands."""
    import json
    import subprocess
    import sys

    script = "import json, sys, outboxkit.cli.apps; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    modules = set(json.loads(done.stdout))
    assert "outboxkit.cli.apps" in modules
    assert not {"click", "outboxkit.cli.group", "outboxkit.cli.ops"} & modules


def test_tracing_and_metrics_cost_no_import_until_asked_for() -> None:
    """Importing outboxkit, its pollers and its command, and running a poller, imports
    neither OpenTelemetry nor prometheus_client (installed here, as the dev extra has them);
    making a ``Tracing`` imports the first."""
    import json
    import subprocess
    import sys

    script = (
        "import json, sys, outboxkit, outboxkit.poller, outboxkit.aio, outboxkit.cli\n"
        "from outboxkit import EventBus, MemoryStore, Outbox\n"
        "bus = EventBus(); bus.subscribe('t', lambda e, c: None, name='h')\n"
        "store = MemoryStore(); outbox = Outbox(store, bus)\n"
        "with store.transaction() as tx: outbox.enqueue(tx, 't', {})\n"
        "assert outbox.poller().run_once().published\n"
        "before = sorted(sys.modules)\n"
        "from outboxkit.contrib.otel import Tracing; Tracing()\n"
        "print(json.dumps([before, sorted(sys.modules)]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    before, after = (set(m) for m in json.loads(done.stdout))
    heavy = {"opentelemetry", "prometheus_client"}
    assert not {m.partition(".")[0] for m in before} & heavy
    assert "opentelemetry" in after
