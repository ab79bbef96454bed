"""No module reads another module's private names.

The packages' modules hand each other what they need through public members: a helper gets an
object with public attributes, not a store whose ``_members`` it reads. This test walks the AST
of every module of the project's packages and fails on

- ``from x import _name`` (and ``import x._name``) of a module of the project, and
- an attribute read ``obj._name`` where ``obj`` is not ``self``, ``cls`` or ``super()``,

except for the driver and standard-library internals listed in ``ALLOWED``, each with its
reason. Dunder names (``__name__``) are not private. A planted violation shows it catches one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("outboxkit", "outboxkit_pg", "outboxkit_sqlite", "outboxkit_mysql")

# (module path relative to the root, or "*" for every module; attribute) -> why it is read.
ALLOWED: dict[tuple[str, str], str] = {
    ("*", "_replace"): "namedtuple's public API (its names start with _ to avoid field clashes)",
    ("*", "_asdict"): "namedtuple's public API",
    ("*", "_fields"): "namedtuple's public API",
    ("*", "_value_"): "enum's documented API for a member's value (faster than .value)",
    ("*", "_exit"): "os._exit, the stdlib's exit without cleanup in a forked child",
    ("*", "_autocommit"): (
        "psycopg: a connection whose BEGIN was sent by the store (pipeline) must be marked "
        "as in a transaction without a round trip; psycopg has no public setter for that"
    ),
    ("outboxkit_sqlite/aio.py", "_connection"): (
        "aiosqlite: the sqlite3 connection an aiosqlite.Connection runs on its thread"
    ),
    ("outboxkit_sqlite/aio.py", "_running"): "aiosqlite: whether its thread still runs",
    ("outboxkit_sqlite/aio.py", "_execute"): (
        "aiosqlite: run a function on the connection's thread (its public API has none)"
    ),
    ("outboxkit_sqlite/aio.py", "_thread"): "aiosqlite: the connection's thread",
    ("outboxkit_sqlite/aio.py", "_tx"): "aiosqlite: the connection's queue of work",
}


def _modules() -> list[Path]:
    found: list[Path] = []
    for package in PACKAGES:
        folder = ROOT / package
        if folder.is_dir():
            found.extend(sorted(folder.rglob("*.py")))
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own(node: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: an object's own members."""
    if isinstance(node, ast.Name):
        return node.id in {"self", "cls"}
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def reaches(source: str, where: str) -> list[str]:
    """The private reaches in one module's source, as ``where:line: what``."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            named = "." * node.level + module
            ours = node.level > 0 or module.partition(".")[0] in PACKAGES
            if ours:
                for alias in node.names:
                    if _private(alias.name):
                        found.append(f"{where}:{node.lineno}: from {named} import {alias.name}")
                if any(_private(part) for part in module.split(".")):
                    found.append(f"{where}:{node.lineno}: from {named} import ...")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in PACKAGES and any(_private(part) for part in parts):
                    found.append(f"{where}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.Attribute) and _private(node.attr) and not _own(node.value):
            if (where, node.attr) in ALLOWED or ("*", node.attr) in ALLOWED:
                continue
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_reads_another_modules_private_names() -> None:
    found: list[str] = []
    for path in _modules():
        where = path.relative_to(ROOT).as_posix()
        found.extend(reaches(path.read_text(encoding="utf-8"), where))
    assert not found, "private reaches:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("planted", "expected"),
    [
        ("from outboxkit.outbox import _check\n", "from outboxkit.outbox import _check"),
        ("from ._sql import base\n", "from ._sql import ..."),
        ("import outboxkit._sql.base\n", "import outboxkit._sql.base"),
        ("def f(store):\n    return store._pool\n", "store._pool"),
        ("class A:\n    def f(self):\n        return self.store._pool\n", "self.store._pool"),
    ],
)
def test_a_planted_reach_is_caught(planted: str, expected: str) -> None:
    found = reaches(planted, "outboxkit/planted.py")
    assert len(found) == 1
    assert found[0].endswith(expected)


def test_own_members_and_allowed_internals_are_not_reaches() -> None:
    source = (
        "class A:\n"
        "    def f(self):\n"
        "        return self._x, super()._y(), type(self).__name__, point._replace(x=1)\n"
    )
    assert reaches(source, "outboxkit/planted.py") == []


def test_the_walk_covers_the_store_packages() -> None:
    where = {path.relative_to(ROOT).parts[0] for path in _modules()}
    assert {"outboxkit", "outboxkit_pg", "outboxkit_sqlite"} <= where
