"""Enqueue overhead: ``outbox.enqueue`` in an app transaction vs a bare INSERT of the same row.

Both run on the same app connection, one after the other in alternating rounds, committing
every ``--commit-every`` operations (default 1: one app transaction per operation, the way an
app enqueues). The bare INSERT writes the same columns of the store's own events table with
plain ``INSERT ... VALUES``. Then ``enqueue_many`` of 100 events vs 100 single ``enqueue`` calls,
each in one transaction, compared per event, next to the same comparison in bare SQL (100
single INSERTs vs one 100-row INSERT): the ceiling the database itself puts on that ratio.

    python bench/enqueue_overhead.py                     # PostgreSQL and SQLite
    python bench/enqueue_overhead.py --backend sqlite --ops 5000 --commit-every 10
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import median, pg_schema, pg_url_default

from outboxkit import EventBus, Outbox

TOPIC = "bench.enqueue"
ROUND = 50  # operations per alternating round
SQLITE_MANY_HEAD = (
    "INSERT INTO outbox_events (topic, payload, headers, key, created_at, available_at) VALUES "
)
SQLITE_MANY_TAIL = " RETURNING id"


def _payload(i: int) -> dict[str, Any]:
    return {"order_id": i, "item": "book", "quantity": 1}


def _time_ops(
    op: Callable[[int], object], commit: Callable[[], None], ops: int, every: int
) -> float:
    """Seconds for ``ops`` calls of ``op``, committing every ``every`` calls (and at the end)."""
    started = time.perf_counter()
    for i in range(ops):
        op(i)
        if (i + 1) % every == 0:
            commit()
    if ops % every:
        commit()
    return time.perf_counter() - started


def compare(
    label: str,
    enqueue_one: Callable[[int], object],
    bare_insert: Callable[[int], object],
    enqueue_many: Callable[[int], object],
    bare_many: Callable[[int], object],
    commit: Callable[[], None],
    args: argparse.Namespace,
) -> None:
    spent = {"bare": 0.0, "kit": 0.0}
    sides = [("bare", bare_insert), ("kit", enqueue_one)]
    for n in range(max(1, args.ops // ROUND)):
        # Alternate, so drift hits both alike, and take turns going first: whichever ran
        # second after the switch was measured 10-15 % slower on SQLite (a fixed order put
        # that on one side only).
        for side, op in sides if n % 2 == 0 else sides[::-1]:
            spent[side] += _time_ops(op, commit, ROUND, args.commit_every)
    kit, bare = spent["kit"], spent["bare"]
    done = max(1, args.ops // ROUND) * ROUND
    print(
        f"{label}: enqueue {kit / done * 1e6:7.1f} us/op | bare INSERT {bare / done * 1e6:7.1f} "
        f"us/op | ratio {kit / bare:.2f}x ({done} ops each, commit every {args.commit_every})",
        flush=True,
    )
    kit_single, kit_many = _per_event(enqueue_one, enqueue_many, commit, args.batches)
    bare_single, bare_batch = _per_event(bare_insert, bare_many, commit, args.batches)
    print(
        f"{label}: 100 single enqueues {kit_single * 1e6:7.1f} us/event | enqueue_many(100) "
        f"{kit_many * 1e6:7.1f} us/event | enqueue_many is {kit_single / kit_many:.1f}x faster "
        f"per event (median of {args.batches} transactions each)",
        flush=True,
    )
    print(
        f"{label}: bare SQL, 100 single INSERTs {bare_single * 1e6:7.1f} us/event | one 100-row "
        f"INSERT {bare_batch * 1e6:7.1f} us/event | {bare_single / bare_batch:.1f}x (the ceiling)",
        flush=True,
    )


def _per_event(
    one: Callable[[int], object],
    many: Callable[[int], object],
    commit: Callable[[], None],
    transactions: int,
) -> tuple[float, float]:
    """Median seconds per event: 100 ``one`` calls in a transaction, and one ``many(100)``."""
    singles: list[float] = []
    batches: list[float] = []
    for _ in range(transactions):
        started = time.perf_counter()
        for i in range(100):
            one(i)
        commit()
        singles.append((time.perf_counter() - started) / 100)
        started = time.perf_counter()
        many(100)
        commit()
        batches.append((time.perf_counter() - started) / 100)
    return median(singles), median(batches)


def bench_pg(args: argparse.Namespace) -> None:
    import psycopg
    from psycopg import sql

    from outboxkit_pg import PostgresStore

    with pg_schema(args.pg_url) as schema:
        store = PostgresStore(args.pg_url, schema=schema)
        try:
            store.migrate()
            outbox = Outbox(store, EventBus(), load_entry_points=False)
            bare_sql = sql.SQL(
                "INSERT INTO {}.outbox_events "
                "(topic, payload, headers, key, created_at, available_at) "
                "VALUES (%s, %s::jsonb, '{{}}'::jsonb, NULL, now(), now()) RETURNING id"
            ).format(sql.Identifier(schema))
            bare_many_sql = sql.SQL(
                "INSERT INTO {}.outbox_events "
                "(topic, payload, headers, key, created_at, available_at) "
                "SELECT t, p::jsonb, '{{}}'::jsonb, NULL, now(), now() "
                "FROM unnest(%b::text[], %b::text[]) AS n (t, p) RETURNING id"
            ).format(sql.Identifier(schema))
            with psycopg.connect(args.pg_url) as conn:
                outbox.enqueue(conn, TOPIC, _payload(0))  # warm up (schema check, prepare)
                conn.commit()

                def bare(i: int) -> None:
                    conn.execute(bare_sql, (TOPIC, json.dumps(_payload(i)))).fetchone()

                def bare_many(n: int) -> None:
                    payloads = [json.dumps(_payload(i)) for i in range(n)]
                    conn.execute(bare_many_sql, ([TOPIC] * n, payloads)).fetchall()

                compare(
                    "pg",
                    lambda i: outbox.enqueue(conn, TOPIC, _payload(i)),
                    bare,
                    lambda n: outbox.enqueue_many(conn, [(TOPIC, _payload(i)) for i in range(n)]),
                    bare_many,
                    conn.commit,
                    args,
                )
        finally:
            store.close()


def bench_sqlite(args: argparse.Namespace) -> None:
    from outboxkit_sqlite import SQLiteStore

    with tempfile.TemporaryDirectory(prefix="outboxkit-bench-") as root:
        path = Path(root) / "enqueue.db"
        store = SQLiteStore(path)
        try:
            outbox = Outbox(store, EventBus(), load_entry_points=False)
            conn = sqlite3.connect(path, timeout=30)  # Python's default transaction handling
            try:
                conn.execute("PRAGMA synchronous=NORMAL")  # as the store's own connections
                bare_sql = (
                    "INSERT INTO outbox_events (topic, payload, headers, key, created_at, "
                    "available_at) VALUES (?, ?, '{}', NULL, ?, ?) RETURNING id"
                )

                def bare(i: int) -> None:
                    now = time.time_ns() // 1000
                    conn.execute(bare_sql, (TOPIC, json.dumps(_payload(i)), now, now)).fetchone()

                def bare_many(n: int) -> None:
                    now = time.time_ns() // 1000
                    values: list[object] = []
                    for i in range(n):
                        values += (TOPIC, json.dumps(_payload(i)), now, now)
                    rows = ", ".join(["(?, ?, '{}', NULL, ?, ?)"] * n)  # placeholders only
                    conn.execute(SQLITE_MANY_HEAD + rows + SQLITE_MANY_TAIL, values).fetchall()

                compare(
                    "sqlite",
                    lambda i: outbox.enqueue(conn, TOPIC, _payload(i)),
                    bare,
                    lambda n: outbox.enqueue_many(conn, [(TOPIC, _payload(i)) for i in range(n)]),
                    bare_many,
                    conn.commit,
                    args,
                )
            finally:
                conn.close()
        finally:
            store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000, help="operations per side")
    parser.add_argument("--commit-every", type=int, default=1)
    parser.add_argument("--batches", type=int, default=30, help="transactions per side (x100)")
    parser.add_argument("--backend", choices=("pg", "sqlite", "all"), default="all")
    parser.add_argument("--pg-url", default=pg_url_default())
    args = parser.parse_args()
    if args.backend in ("pg", "all"):
        bench_pg(args)
    if args.backend in ("sqlite", "all"):
        bench_sqlite(args)


if __name__ == "__main__":
    main()
