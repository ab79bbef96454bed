"""The pure core stays pure: no driver, no clock, no logging, no pluggy (STYLE.md, issue 2)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import outboxkit

PACKAGE_DIR = Path(outboxkit.__file__).parent
PURE_MODULES = ["_machine", "_backoff", "_model", "_payload", "_duration"]
ALLOWED_OUTBOXKIT = {"_model", "_backoff", "errors", "_payload", "_duration"}
FORBIDDEN_ROOTS = {
    "time",
    "logging",
    "pluggy",
    "sqlite3",
    "sqlite_utils",
    "psycopg",
    "psycopg_pool",
    "threading",
    "socket",
    "os",
}
CLOCK_READS = {"now", "utcnow", "today"}


def _imported_modules(tree: ast.AST) -> list[str]:
    """Absolute dotted names of every module the source imports (relative ones resolved)."""
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                assert node.module is not None
                found.append(node.module)
            elif node.level == 1:
                # "from . import x" imports outboxkit.x; "from .m import x" imports outboxkit.m.
                if node.module is None:
                    found.extend(f"outboxkit.{alias.name}" for alias in node.names)
                else:
                    found.append(f"outboxkit.{node.module}")
            else:
                found.append("." * node.level + (node.module or ""))  # outside the package
    return found


def purity_violations(source: str) -> list[str]:
    tree = ast.parse(source)
    problems: list[str] = []
    for name in _imported_modules(tree):
        root = name.split(".")[0]
        if root in FORBIDDEN_ROOTS:
            problems.append(f"imports {name}")
        elif name.startswith("."):
            problems.append(f"imports {name} from outside the package")
        elif root == "outboxkit":
            rest = name.split(".")[1:]
            if not rest or rest[0] not in ALLOWED_OUTBOXKIT:
                problems.append(f"imports {name}, which is not part of the pure core")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in CLOCK_READS
        ):
            problems.append(f"reads a clock: .{node.func.attr}() on line {node.lineno}")
    return problems


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_core_module_imports_nothing_impure(module: str) -> None:
    path = PACKAGE_DIR / f"{module}.py"
    assert purity_violations(path.read_text(encoding="utf-8")) == []


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
        ("from .clock import SystemClock", "imports outboxkit.clock"),
        ("from . import plugins", "imports outboxkit.plugins"),
        ("from outboxkit import memory", "imports outboxkit,"),
        ("from outboxkit.poller import Poller", "imports outboxkit.poller"),
        ("def f():\n    import time\n", "imports time"),
        ("from datetime import datetime\nx = datetime.now()", "reads a clock: .now()"),
        ("import datetime\nx = datetime.datetime.utcnow()", "reads a clock: .utcnow()"),
        ("from datetime import date\nx = date.today()", "reads a clock: .today()"),
        ("def f(clock):\n    return clock.now()\n", "reads a clock: .now()"),
    ],
)
def test_purity_check_catches_violations(source: str, expected: str) -> None:
    problems = purity_violations(source)
    assert any(p.startswith(expected) for p in problems), problems


@pytest.mark.parametrize(
    "source",
    [
        "from ._model import State",
        "from .errors import InvalidEvent",
        "from ._backoff import delay_for",
        "from outboxkit._payload import build_event",
        "import json, math, enum, random\nfrom datetime import datetime, timedelta",
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
