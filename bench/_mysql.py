"""MariaDB/MySQL in ``bench/compare.py``: the hand-written loops and outboxkit's poller, each
event's handler writing one row (``ledger``) in the delivery's transaction.

The references (one table of events, one of delivery records, the ledger; no token, no keys):

- per event: ``BEGIN``, claim 100 with ``SELECT ... FOR UPDATE SKIP LOCKED`` and lease them
  (``UPDATE``: lease, attempts + 1), ``COMMIT``; per event ``BEGIN``, the handler's ``INSERT``,
  the record's ``INSERT``, ``COMMIT``; then mark the batch published in one statement;
- per batch: one transaction per batch: claim (``FOR UPDATE SKIP LOCKED``), the handlers'
  rows, ``executemany`` of the records, mark; ``batch-sp``: the same with a ``SAVEPOINT`` before
  each handler, so that a failing handler undoes only its own writes (``per_batch``'s rule).

The server comes from ``OUTBOXKIT_BENCH_MYSQL_URL`` (default ``mysql://root@127.0.0.1:3306/test``,
whose database is only used to connect); each drain runs in a database of its own.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

DEFAULT_URL = "mysql://root@127.0.0.1:3306/test"
URL_ENV = "OUTBOXKIT_BENCH_MYSQL_URL"
TOPIC = "bench.compare"
HANDLER = "ledger"

REF_DDL = [
    """CREATE TABLE ref_events (
        id BIGINT AUTO_INCREMENT PRIMARY KEY, topic VARCHAR(255) NOT NULL,
        payload LONGTEXT NOT NULL, attempts INT NOT NULL DEFAULT 0,
        leased_until DATETIME(6) NULL, published_at DATETIME(6) NULL,
        KEY due (published_at, id)) ENGINE=InnoDB""",
    """CREATE TABLE ref_records (
        event_id BIGINT NOT NULL, handler VARCHAR(255) NOT NULL,
        recorded_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
        PRIMARY KEY (event_id, handler)) ENGINE=InnoDB""",
]
LEDGER_DDL = "CREATE TABLE ledger (event_id BIGINT NOT NULL, note VARCHAR(16)) ENGINE=InnoDB"
REF_CLAIM = """SELECT id, topic, payload FROM ref_events
 WHERE published_at IS NULL AND (leased_until IS NULL OR leased_until < UTC_TIMESTAMP(6))
 ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED"""
REF_LEASE = """UPDATE ref_events
   SET leased_until = UTC_TIMESTAMP(6) + INTERVAL 30 SECOND, attempts = attempts + 1
 WHERE id IN %s"""
REF_RECORD = "INSERT INTO ref_records (event_id, handler) VALUES (%s, %s)"
REF_MARK = (
    "UPDATE ref_events SET published_at = UTC_TIMESTAMP(6), leased_until = NULL WHERE id IN %s"
)
LEDGER = "INSERT INTO ledger (event_id, note) VALUES (%s, 'done')"


def server_url() -> str:
    return os.environ.get(URL_ENV, DEFAULT_URL)


def _args(url: str) -> dict[str, Any]:
    parts = urlsplit(url)
    return {
        "host": parts.hostname or "127.0.0.1",
        "port": parts.port or 3306,
        "user": parts.username or "root",
        "password": parts.password or "",
        "database": parts.path.lstrip("/") or None,
    }


def connect(url: str, **options: Any) -> Any:
    import pymysql

    conn = pymysql.connect(**_args(url), autocommit=True, **options)
    with conn.cursor() as cur:
        cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
    return conn


@contextlib.contextmanager
def fresh_database(prefix: str = "outboxkit_compare") -> Iterator[str]:
    """A fresh database on the server (its URL), dropped afterwards."""
    url = server_url()
    name = f"{prefix}_{os.getpid()}_{secrets.token_hex(3)}"
    with contextlib.closing(connect(url)) as conn, conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE `{name}`")
    parts = urlsplit(url)
    try:
        yield urlunsplit((parts.scheme, parts.netloc, "/" + name, "", ""))
    finally:
        with contextlib.closing(connect(url)) as conn, conn.cursor() as cur:
            cur.execute(f"DROP DATABASE IF EXISTS `{name}`")


def prepare(url: str, kind: str, events: int) -> None:
    """The contender's tables, holding ``events`` due events (and the ledger)."""
    import json

    with contextlib.closing(connect(url)) as conn, conn.cursor() as cur:
        cur.execute(LEDGER_DDL)
        if kind == "ref":
            for ddl in REF_DDL:
                cur.execute(ddl)
            rows = [(TOPIC, json.dumps({"n": n})) for n in range(events)]
            for start in range(0, events, 1000):
                cur.executemany(
                    "INSERT INTO ref_events (topic, payload) VALUES (%s, %s)",
                    rows[start : start + 1000],
                )
            return
    from outboxkit import EventBus, Outbox
    from outboxkit_mysql import MySQLStore

    with contextlib.closing(MySQLStore(url)) as store:
        store.migrate()
        outbox = Outbox(store, EventBus(), load_entry_points=False)
        for start in range(0, events, 1000):
            with store.transaction() as tx:
                outbox.enqueue_many(
                    tx, [(TOPIC, {"n": n}) for n in range(start, min(events, start + 1000))]
                )


def counts(url: str, kind: str) -> tuple[int, int, int]:
    """(events settled, events recorded, ledger rows) after a drain."""
    if kind == "ref":
        settled = "SELECT COUNT(*) FROM ref_events WHERE published_at IS NOT NULL"
        records = "SELECT COUNT(DISTINCT event_id) FROM ref_records"
    else:
        settled = "SELECT COUNT(*) FROM outbox_events WHERE published_at IS NOT NULL"
        records = (
            "SELECT COUNT(DISTINCT event_id) FROM outbox_deliveries WHERE outcome = 'succeeded'"
        )
    found = []
    with contextlib.closing(connect(url)) as conn, conn.cursor() as cur:
        for query in (settled, records, "SELECT COUNT(DISTINCT event_id) FROM ledger"):
            cur.execute(query)
            found.append(int(cur.fetchone()[0]))
    return found[0], found[1], found[2]


def ref_worker(url: str, mode: str, batch: int, barrier: Any) -> tuple[float, float, int]:
    """The hand-written loop (see the module docstring): (started, ended, handled)."""
    conn = connect(url)
    cur = conn.cursor()
    handled = 0
    barrier.wait()
    started = time.monotonic()
    while True:
        conn.begin()
        cur.execute(REF_CLAIM, (batch,))
        rows = cur.fetchall()
        ids = tuple(row[0] for row in rows)
        if mode in ("batch", "batch-sp"):
            for event_id, _, _ in rows:
                if mode == "batch-sp":  # a savepoint: a failing handler undoes its own writes
                    cur.execute("SAVEPOINT handler")
                cur.execute(LEDGER, (event_id,))  # the handler
            if rows:
                cur.executemany(REF_RECORD, [(event_id, HANDLER) for event_id in ids])
                cur.execute(REF_MARK, (ids,))
            conn.commit()
        else:
            if rows:
                cur.execute(REF_LEASE, (ids,))
            conn.commit()
            for event_id, _, _ in rows:
                conn.begin()
                cur.execute(LEDGER, (event_id,))  # the handler
                cur.execute(REF_RECORD, (event_id, HANDLER))
                conn.commit()
            if rows:
                cur.execute(REF_MARK, (ids,))
        if not rows:
            break
        handled += len(rows)
    ended = time.monotonic()
    conn.close()
    return started, ended, handled


def kit_worker(url: str, mode: str, batch: int, barrier: Any) -> tuple[float, float, int]:
    """outboxkit's blocking poller on the MySQL store: (started, ended, handled)."""
    from outboxkit import EventBus, Outbox
    from outboxkit.poller import ThreadWaiter
    from outboxkit_mysql import MySQLStore

    calls = [0]
    bus = EventBus()

    @bus.handler(TOPIC, name=HANDLER)
    def ledger(event: Any, ctx: Any) -> None:
        with ctx.connection.cursor() as cur:
            cur.execute(LEDGER, (event.id,))
        calls[0] += 1

    store = MySQLStore(url)
    outbox = Outbox(store, bus, load_entry_points=False)
    transaction = "per_batch" if mode in ("batch", "batch-sp") else "per_event"
    poller = outbox.poller(batch_size=batch, waiter=ThreadWaiter(), transaction=transaction)
    with store.transaction():  # connected before the clock starts
        pass
    barrier.wait()
    started = time.monotonic()
    while poller.run_once():
        pass
    ended = time.monotonic()
    store.close()
    return started, ended, calls[0]
