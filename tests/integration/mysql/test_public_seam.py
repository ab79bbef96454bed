"""The MariaDB/MySQL store is built on the public store seam alone: every import of outboxkit
is ``outboxkit.storekit`` (or a module of it), no imported name and no attribute it reads on
another object is private, and the package does not grow."""

from __future__ import annotations

import ast
from pathlib import Path

import outboxkit_mysql

PACKAGE = Path(outboxkit_mysql.__file__).parent
MODULES = sorted(PACKAGE.glob("*.py"))


def imports_of(tree: ast.AST) -> list[tuple[str, list[str]]]:
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
    return found


def test_every_import_of_outboxkit_is_the_public_seam() -> None:
    assert len(MODULES) >= 5
    for path in MODULES:
        for module, names in imports_of(ast.parse(path.read_text())):
            if module.split(".")[0] != "outboxkit":
                continue
            assert module == "outboxkit.storekit" or module.startswith("outboxkit.storekit."), (
                f"{path.name} imports {module}"
            )
            assert not any(part.startswith("_") for part in module.split(".")), module
            assert not any(name.startswith("_") for name in names), (path.name, names)


def test_no_private_attribute_of_another_object_is_read() -> None:
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                owner = node.value
                assert isinstance(owner, ast.Name) and owner.id in ("self", "cls"), (
                    f"{path.name}:{node.lineno} reads .{node.attr}"
                )


def test_the_package_is_small_and_has_no_type_ignore() -> None:
    files = [*MODULES, PACKAGE / "queries.sql"]
    lines = sum(len(path.read_text().splitlines()) for path in files)
    # The target: under 1,000 lines, SQL included; what is generic is outboxkit.storekit's
    # (run_steps, ConnectionPool, PooledDialect with its rows, execute and script,
    # GuardedConnection, LazyDelivery with its deferred opening, pooled_batch, SQLBatch.lock,
    # SQLStore's migrate and clock, the JSONRows and NaiveUTC values, StoreClass).
    assert lines < 1000, lines
    for path in files:
        assert "type: ignore" not in path.read_text(), path.name
