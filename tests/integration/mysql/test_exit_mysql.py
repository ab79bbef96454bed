"""A process that ends without closing its MySQL store (a poller stopped, a script done) says
goodbye to the server on its connections: PyMySQL does not when a connection is collected, and
the server then logs each one as an aborted connection."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.mysql

_SCRIPT = """
import atexit, os
from outboxkit_mysql import MySQLStore

held = []


def report():  # registered first: runs after the store's own exit hook
    print("open" if held[0].open else "closed", flush=True)


atexit.register(report)
store = MySQLStore(os.environ["OUTBOXKIT_EXIT_TEST_URL"])
store.migrate()
store.now()  # a connection taken and handed back: idle in the store's pool
held.extend(store.dialect.pool.idle)
print("connections", len(held), flush=True)
"""


def test_a_store_not_closed_closes_its_connections_when_the_process_exits(
    mysql_url: str,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        env={**os.environ, "OUTBOXKIT_EXIT_TEST_URL": mysql_url},  # never a process argument
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.splitlines() == ["connections 1", "closed"]
