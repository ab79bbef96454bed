"""The statements of one delivery inside a batch transaction, sent in different flights: what a
round trip, a token check and a savepoint cost per event, on PostgreSQL or MariaDB.

Each shape sends, for every event of a batch of 100 inside one transaction (rolled back after
it), the statements a handler writing one row needs under ``per_batch``'s rule (a savepoint, so
that a failing handler undoes only its own writes) and, for outboxkit's, the token check with
its row lock (R6):

- ``loop``: the hand-written loop of ``compare.py``: the savepoint, then the insert (two round
  trips);
- ``split``: the savepoint with the token check in one flight, then the insert (two round
  trips: a delivery's opening in a flight of its own, as the PostgreSQL store sends it, and as
  the MariaDB store did before its opening went with the handler's first statement);
- ``ahead``: the savepoint, the token check and the insert in one flight (one round trip: the
  MariaDB store's opening sent ahead of the handler's first statement);
- ``unchecked``: the savepoint and the insert in one flight, no check (the MariaDB store inside
  a batch whose tokens were checked once, ``SQLBatch.lock``).

The check is each store's own: ``SELECT ... FOR UPDATE`` by id and token (PostgreSQL, in a
pipeline sync), ``SELECT id INTO @var ... FOR UPDATE`` (MariaDB, several statements in one
``COM_QUERY``). Shapes take turns, in either order, batch after batch; the medians of the
microseconds per event are printed. Not a throughput figure (``compare.py`` is): where the time
of a batch's delivery goes, with no Python of outboxkit's.

    python bench/flight_shapes.py --db pg
    python bench/flight_shapes.py --db mysql --batches 12

The servers: ``OUTBOXKIT_BENCH_PG_URL`` (default ``postgresql://postgres@127.0.0.1:5432/postgres``;
a schema of its own, dropped at the end) and ``OUTBOXKIT_BENCH_MYSQL_URL`` (``bench/_mysql.py``:
a database of its own).
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing, contextmanager
from typing import Any

SHAPES = ("loop", "split", "ahead", "unchecked")
PER_BATCH = 100
Send = Callable[[int, str], None]


@contextmanager
def pg_shapes(events: int) -> Iterator[tuple[dict[str, Send], Callable[[], None], list[Any]]]:
    """PostgreSQL's shapes on one connection, a schema of its own with ``events`` claimed
    rows; what ends a batch (rollback) and the rows (id, token)."""
    import psycopg
    from psycopg import sql

    url = os.environ.get("OUTBOXKIT_BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    schema = sql.Identifier(f"flight_shapes_{secrets.token_hex(3)}")
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE SCHEMA {}").format(schema))
        try:
            admin.execute(
                sql.SQL(
                    "CREATE TABLE {}.ev (id bigint PRIMARY KEY, token uuid NOT NULL,"
                    " published_at timestamptz, failed_at timestamptz)"
                ).format(schema)
            )
            admin.execute(
                sql.SQL("CREATE TABLE {}.ledger (event_id bigint, note text)").format(schema)
            )
            admin.execute(
                sql.SQL(
                    "INSERT INTO {}.ev SELECT g, gen_random_uuid() FROM generate_series(1, %s) g"
                ).format(schema),
                (events,),
            )
            rows = admin.execute(sql.SQL("SELECT id, token FROM {}.ev ORDER BY id").format(schema))
            claimed = rows.fetchall()
            lock = sql.SQL(
                "SELECT id FROM {}.ev WHERE id = %s AND token = %s"
                " AND coalesce(published_at, failed_at) IS NULL FOR UPDATE"
            ).format(schema)
            insert = sql.SQL("INSERT INTO {}.ledger VALUES (%s, 'done')").format(schema)
            with psycopg.connect(url) as conn:

                def loop(event_id: int, token: str) -> None:
                    conn.execute("SAVEPOINT delivery")
                    conn.execute(insert, (event_id,))

                def split(event_id: int, token: str) -> None:
                    with conn.pipeline():
                        conn.execute("SAVEPOINT delivery")
                        check = conn.execute(lock, (event_id, token), prepare=True)
                    assert check.fetchall()
                    conn.execute(insert, (event_id,))

                def ahead(event_id: int, token: str) -> None:
                    with conn.pipeline():
                        conn.execute("SAVEPOINT delivery")
                        check = conn.execute(lock, (event_id, token), prepare=True)
                        conn.execute(insert, (event_id,))
                    assert check.fetchall()

                def unchecked(event_id: int, token: str) -> None:
                    with conn.pipeline():
                        conn.execute("SAVEPOINT delivery")
                        conn.execute(insert, (event_id,))

                shapes = {"loop": loop, "split": split, "ahead": ahead, "unchecked": unchecked}
                yield shapes, conn.rollback, claimed
        finally:
            admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(schema))


@contextmanager
def mysql_shapes(events: int) -> Iterator[tuple[dict[str, Send], Callable[[], None], list[Any]]]:
    """MariaDB's shapes, as ``pg_shapes``, in a database of its own."""
    import _mysql
    from pymysql.constants import CLIENT

    with _mysql.fresh_database("flight_shapes") as url:
        with closing(_mysql.connect(url)) as admin, admin.cursor() as cur:
            cur.execute(
                "CREATE TABLE ev (id BIGINT PRIMARY KEY, token CHAR(32) NOT NULL,"
                " published_at DATETIME(6) NULL, failed_at DATETIME(6) NULL) ENGINE=InnoDB"
            )
            cur.execute("CREATE TABLE ledger (event_id BIGINT, note VARCHAR(16)) ENGINE=InnoDB")
            rows = [(n, secrets.token_hex(16)) for n in range(1, events + 1)]
            cur.executemany("INSERT INTO ev (id, token) VALUES (%s, %s)", rows)
        conn = _mysql.connect(url, client_flag=CLIENT.MULTI_STATEMENTS)
        with closing(conn), conn.cursor() as cur:
            check = (
                "SELECT id INTO @owned FROM ev WHERE id = %s AND token = %s"
                " AND published_at IS NULL AND failed_at IS NULL FOR UPDATE"
            )
            insert = "INSERT INTO ledger VALUES (%s, 'done')"

            def flight(*statements: str) -> None:
                cur.execute(";".join(statements))
                while cur.nextset():
                    pass

            def loop(event_id: int, token: str) -> None:
                flight("SAVEPOINT delivery")
                flight(cur.mogrify(insert, (event_id,)))

            def split(event_id: int, token: str) -> None:
                flight("SAVEPOINT delivery", cur.mogrify(check, (event_id, token)))
                flight(cur.mogrify(insert, (event_id,)))

            def ahead(event_id: int, token: str) -> None:
                flight(
                    "SAVEPOINT delivery",
                    cur.mogrify(check, (event_id, token)),
                    cur.mogrify(insert, (event_id,)),
                )

            def unchecked(event_id: int, token: str) -> None:
                flight("SAVEPOINT delivery", cur.mogrify(insert, (event_id,)))

            def begin_and_end() -> None:
                conn.rollback()
                conn.begin()

            conn.begin()
            shapes = {"loop": loop, "split": split, "ahead": ahead, "unchecked": unchecked}
            yield shapes, begin_and_end, rows
            conn.rollback()


def measure(
    shapes: dict[str, Send], end_batch: Callable[[], None], rows: Sequence[Any], batches: int
) -> dict[str, list[float]]:
    """µs per event of each shape, batch by batch, the shapes taking turns in either order."""
    timings: dict[str, list[float]] = {name: [] for name in shapes}
    position = 0
    for turn in range(batches):
        order = list(shapes) if turn % 2 == 0 else list(shapes)[::-1]
        for name in order:
            batch = rows[position : position + PER_BATCH]
            position += PER_BATCH
            started = time.perf_counter()
            for event_id, token in batch:
                shapes[name](event_id, token)
            timings[name].append((time.perf_counter() - started) / len(batch) * 1e6)
            end_batch()
    return timings


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", choices=("pg", "mysql"), required=True)
    parser.add_argument("--batches", type=int, default=8, help="batches of 100 per shape")
    args = parser.parse_args(argv)
    if args.batches < 1:
        parser.error(f"--batches must be at least 1, got {args.batches}")
    events = args.batches * PER_BATCH * len(SHAPES)
    shapes_of = pg_shapes if args.db == "pg" else mysql_shapes
    with shapes_of(events) as (shapes, end_batch, rows):
        timings = measure(shapes, end_batch, rows, args.batches)
    print(f"flight_shapes --db {args.db}: {args.batches} batches of {PER_BATCH} per shape")
    for name, values in timings.items():
        rounds = ", ".join(f"{v:.0f}" for v in values)
        print(f"  {name:10s} {statistics.median(values):7.1f} µs/event  ({rounds})")


if __name__ == "__main__":
    main()
