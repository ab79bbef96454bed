"""The tutorial "Put it in production" runs as written, on a database of its own: the first
tutorial's ``shop.py`` with the page's changed functions, its ``production.py``, and its
commands (``migrate``, ``run`` - until idle instead of until a signal -, ``status``,
``dead list``)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql

from tests.docs import blocks, page, python_blocks

pytestmark = pytest.mark.pg

PAGE = page("tutorials/production.md")
FIRST = page("tutorials/first-test.md")


def functions(source: str) -> dict[str, str]:
    tree = ast.parse(source)
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            lines = source.splitlines()[start - 1 : node.end_lineno]
            found[node.name] = "\n".join(lines)
    return found


def shop_on_postgres() -> str:
    """The first tutorial's shop.py with the functions the page changes replaced."""
    (shop, _) = python_blocks(FIRST)
    (changed, _) = python_blocks(PAGE)
    assert changed.startswith("# shop.py (the changed parts)")
    old, new = functions(shop), functions(changed)
    assert set(new) <= set(old), set(new) - set(old)
    for name, code in new.items():
        shop = shop.replace(old[name], code)
    return shop


@pytest.fixture
def database(pg_url: str) -> Iterator[str]:
    """A database of the tutorial's own: the URL of it."""
    name = f"okt_tutorial_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    parts = urlsplit(pg_url)
    url = urlunsplit((parts.scheme, parts.netloc, f"/{name}", "", ""))
    try:
        yield url
    finally:
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def test_the_tutorial_on_postgresql(tmp_path: Path, database: str) -> None:
    (_, production) = python_blocks(PAGE)
    (tmp_path / "shop.py").write_text(shop_on_postgres(), encoding="utf-8")
    (tmp_path / "production.py").write_text(production, encoding="utf-8")
    env = {**os.environ, "SHOP_DATABASE_URL": database, "PYTHONPATH": str(tmp_path)}
    outboxkit = [sys.executable, "-m", "outboxkit"]

    def command(line: str) -> subprocess.CompletedProcess[str]:
        assert line.startswith("outboxkit "), line
        args = line.split()[1:]
        if args[0] == "run":  # until idle, not until a signal
            args.append("--until-idle")
        return subprocess.run(
            outboxkit + args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )

    setup, watching = (b for b in blocks(PAGE, "bash") if "outboxkit " in b)
    assert "pip install" in blocks(PAGE, "bash")[0]
    migrate, run = setup.strip().splitlines()
    assert command(migrate).returncode == 0

    # The app places orders (the shop's tables made as the page's create_tables does).
    script = (
        "import production, shop\n"
        "with production.store.transaction() as conn:\n"
        "    shop.create_tables(conn)\n"
        "print([shop.place_order(production.outbox, 'tea', n) for n in (1, 2, 0)])\n"
    )
    placed = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert placed.returncode == 0, placed.stderr
    assert placed.stdout.strip() == "[1, 2, 3]"

    ran = command(run)
    assert ran.returncode == 0, ran.stderr
    status, dead, web = watching.strip().splitlines()
    assert web.startswith("outboxkit web --app production:outbox")  # serves until stopped
    shown = command(status)
    assert shown.returncode == 0, shown.stderr
    listed = command(dead)
    assert listed.returncode == 0, listed.stderr
    with psycopg.connect(database) as conn:
        published = conn.execute(
            "SELECT topic, count(*) FROM outbox_events WHERE published_at IS NOT NULL"
            " GROUP BY topic ORDER BY topic"
        ).fetchall()
        reserved = conn.execute("SELECT order_id FROM reservations ORDER BY 1").fetchall()
    # Three orders: two reserved (and their follow-ups mailed), the empty one rejected.
    assert published == [("order.placed", 3), ("stock.reserved", 2)]
    assert reserved == [(1,), (2,)]
