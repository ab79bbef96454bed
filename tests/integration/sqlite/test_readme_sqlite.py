"""The README's SQLite example runs as written."""

from __future__ import annotations

import re
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from tests.docs import page


def test_readme_sqlite_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    section = page("how-to/sqlite.md")
    (example,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "docs/how-to/sqlite.md", "exec"), {"__name__": "readme_sqlite"})
    with closing(sqlite3.connect(tmp_path / "app.db")) as conn:
        assert conn.execute("SELECT count(*) FROM orders").fetchone() == (1,)
        assert conn.execute("SELECT order_id FROM ledger").fetchall() == [(1,)]
        assert conn.execute(
            "SELECT count(*) FROM outbox_events WHERE published_at IS NOT NULL"
        ).fetchone() == (1,)
