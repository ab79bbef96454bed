"""The MariaDB/MySQL page's example runs as written, against the test server in a database
of its own (the URL and the app's connection swapped for the test's)."""

from __future__ import annotations

import re
from typing import Any

import pymysql

from tests.docs import page

from .server import connect_args


def test_readme_mysql_example_runs(mysql_url: str) -> None:
    section = page("how-to/mysql.md")
    (example,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    app = 'pymysql.connect(host="127.0.0.1", user="app", database="app")'
    assert 'DATABASE_URL = "mysql://app@127.0.0.1:3306/app"' in example and app in example
    args = {**connect_args(mysql_url), "database": mysql_url.rsplit("/", 1)[1]}
    code = example.replace("mysql://app@127.0.0.1:3306/app", mysql_url).replace(
        app, f"pymysql.connect(**{args!r})"
    )
    namespace: dict[str, Any] = {"__name__": "readme_mysql"}
    exec(compile(code, "docs/how-to/mysql.md", "exec"), namespace)
    with pymysql.connect(**args) as conn, conn.cursor() as cur:
        cur.execute("SELECT COUNT(*) FROM ledger")
        ledger = cur.fetchone()
        cur.execute("SELECT COUNT(*) FROM outbox_events WHERE published_at IS NOT NULL")
        published = cur.fetchone()
    assert (ledger, published) == ((1,), (1,))
