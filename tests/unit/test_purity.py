"""The pure core stays pure: the rule of the folder ``outboxkit/core/``.

Every module in the folder (whatever it is called, however many there are) may import only the
folder's own modules, ``outboxkit.errors`` and a short list of standard-library modules that do
no I/O; it may not read a clock (``.now()``, ``.utcnow()``, ``.today()``), open a file or print.
A new module that breaks the rule fails here by its file name, without anyone adding it to a list.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import outboxkit

CORE = Path(outboxkit.__file__).parent / "core"
CORE_MODULES = sorted(p.stem for p in CORE.glob("*.py"))
STDLIB_ALLOWED = {
    "__future__",
    "collections",
    "dataclasses",
    "datetime",  # the types; reading the clock is caught separately
    "enum",
    "functools",
    "json",
    "math",
    "random",  # the backoff's optional jitter
    "re",
    "types",
    "typing",
    "typing_extensions",
    "urllib",  # urllib.parse only: pure string functions
}
CLOCK_READS = {"now", "utcnow", "today", "monotonic", "time", "perf_counter"}
IO_CALLS = {"open", "print", "input", "exec", "eval", "__import__"}


def _imported_modules(tree: ast.AST, package: str) -> list[str]:
    """Absolute dotted names of every module the source imports (relative ones resolved
    against ``package``, the package the module is in), at any depth: inside functions too."""
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                assert node.module is not None
                found.append(node.module)
                continue
            base = package.split(".")
            if node.level > 1:
                base = base[: -(node.level - 1)]
            if node.module is None:
                found.extend(".".join([*base, alias.name]) for alias in node.names)
            else:
                found.append(".".join([*base, node.module]))
    return found


def purity_violations(source: str, package: str = "outboxkit.core") -> list[str]:
    tree = ast.parse(source)
    problems: list[str] = []
    for name in _imported_modules(tree, package):
        root = name.split(".")[0]
        if root == "outboxkit":
            if not (name.startswith("outboxkit.core") or name == "outboxkit.errors"):
                problems.append(f"imports {name}, which is outside the pure core")
        elif (
            root == "urllib" and name not in ("urllib", "urllib.parse")
        ) or root not in STDLIB_ALLOWED:
            problems.append(f"imports {name}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Attribute) and node.func.attr in CLOCK_READS:
            problems.append(f"reads a clock: .{node.func.attr}() on line {node.lineno}")
        if isinstance(node.func, ast.Name) and node.func.id in IO_CALLS:
            problems.append(f"calls {node.func.id}() on line {node.lineno}")
    return problems


def test_the_core_folder_holds_the_pure_modules() -> None:
    assert {"machine", "model", "backoff", "payload", "duration", "options", "text"} <= set(
        CORE_MODULES
    )


@pytest.mark.parametrize("module", CORE_MODULES)
def test_every_core_module_is_pure(module: str) -> None:
    source = (CORE / f"{module}.py").read_text(encoding="utf-8")
    # Relative imports resolve against the package the module is in: outboxkit.core.
    assert purity_violations(source, "outboxkit.core") == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import time", "imports time"),
        ("import os.path", "imports os.path"),
        ("from logging import getLogger", "imports logging"),
        ("import pluggy", "imports pluggy"),
        ("import sqlite3", "imports sqlite3"),
        ("from sqlite_utils import Database", "imports sqlite_utils"),
        ("import psycopg.sql", "imports psycopg.sql"),
        ("import threading", "imports threading"),
        ("import socket", "imports socket"),
        ("import asyncio", "imports asyncio"),
        ("import urllib.request", "imports urllib.request"),
        ("from ..clock import SystemClock", "imports outboxkit.clock"),
        ("from .. import plugins", "imports outboxkit.plugins"),
        ("from outboxkit import memory", "imports outboxkit,"),
        ("from outboxkit.poller import Poller", "imports outboxkit.poller"),
        ("def f():\n    import time\n", "imports time"),
        ("from datetime import datetime\nx = datetime.now()", "reads a clock: .now()"),
        ("import datetime\nx = datetime.datetime.utcnow()", "reads a clock: .utcnow()"),
        ("from datetime import date\nx = date.today()", "reads a clock: .today()"),
        ("def f(clock):\n    return clock.now()\n", "reads a clock: .now()"),
        ("def f(t):\n    return t.monotonic()\n", "reads a clock: .monotonic()"),
        ("def f():\n    print('hello')\n", "calls print()"),
        ("def f(p):\n    return open(p).read()\n", "calls open()"),
    ],
)
def test_purity_check_catches_violations(source: str, expected: str) -> None:
    problems = purity_violations(source)
    assert any(p.startswith(expected) for p in problems), problems


@pytest.mark.parametrize(
    "source",
    [
        "from .model import State",
        "from ..errors import InvalidEvent",
        "from .backoff import delay_for",
        "from outboxkit.core.payload import build_event",
        "from outboxkit.errors import OutboxError",
        "import json, math, enum, random\nfrom datetime import datetime, timedelta",
        "from urllib.parse import urlsplit",
        "def f(*, now):\n    return now",
    ],
)
def test_purity_check_allows_the_pure_imports(source: str) -> None:
    assert purity_violations(source) == []


def _modules_after(code: str) -> list[str]:
    script = f"import json, sys\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    return list(json.loads(result.stdout.strip().splitlines()[-1]))


def test_importing_outboxkit_imports_no_database_driver() -> None:
    modules = _modules_after("import outboxkit")
    assert "outboxkit" in modules  # the import really happened
    assert [m for m in modules if m.split(".")[0] in {"psycopg", "psycopg_pool"}] == []


def test_opening_a_memory_store_loads_plugins_without_importing_psycopg() -> None:
    modules = _modules_after("import outboxkit\noutboxkit.open_store('memory://')")
    assert "outboxkit.memory" in modules
    assert [m for m in modules if m.split(".")[0] in {"psycopg", "psycopg_pool"}] == []
