"""SQLite per batch, statement by statement: the minimal loop's against the SQLite store's own.

Drains ``--events`` events in batches of 100 with plain ``sqlite3`` at the store's settings (WAL,
``synchronous=NORMAL``), once with the minimal per-batch loop of ``compare.py`` (one
transaction: claim, records, mark, commit) and once with the store's statements (the claim in a
transaction of its own, as the poller commits it so that the attempt counts; then records
fenced by token and the fenced settlement in the batch's transaction), timing each statement.
Prints microseconds per event for each, and the totals, median of ``--rounds`` runs (the two
sides alternate). Not a throughput figure: where the database's time per event goes.

    python bench/sqlite_statements.py
    python bench/sqlite_statements.py --events 20000 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import tempfile
import time
from contextlib import closing
from pathlib import Path
from statistics import median
from typing import Any

import compare

from outboxkit import EventBus, Outbox
from outboxkit_sqlite import SQLiteStore

BATCH = 100
Timings = dict[str, float]


class Timed:
    """Runs statements on ``conn``, adding each one's time (rows fetched) to ``timings``."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.timings: Timings = {}

    def __call__(self, name: str, statement: str, params: Any = (), *, many: bool = False) -> Any:
        started = time.perf_counter()
        if many:
            self.conn.executemany(statement, params)
            rows = None
        else:
            rows = self.conn.execute(statement, params).fetchall()
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - started
        return rows


def minimal(path: Path, events: int) -> Timings:
    """The minimal per-batch loop's statements, timed."""
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.executescript(compare.SQLITE_REF_DDL)
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT INTO ref_events (topic, payload) VALUES (?, ?)",
            [(compare.TOPIC, json.dumps({"n": n})) for n in range(events)],
        )
        conn.execute("COMMIT")
    with closing(compare._sqlite_connect(str(path))) as conn:
        timed = Timed(conn)
        while True:
            now = time.time()
            conn.execute("BEGIN IMMEDIATE")
            claim = {"now": now, "until": now + 30, "batch": BATCH}
            rows = timed("claim", compare.SQLITE_REF_CLAIM, claim)
            if not rows:
                conn.execute("COMMIT")
                return timed.timings
            records = [(row[0], compare.HANDLER, now) for row in rows]
            timed("records", compare.SQLITE_REF_RECORD, records, many=True)
            mark = {"now": now, "ids": json.dumps([row[0] for row in rows])}
            timed("settle", compare.SQLITE_REF_MARK, mark)
            timed("commit", "COMMIT")


def store_statements(path: Path, events: int) -> Timings:
    """The SQLite store's per-batch statements (``queries.sql``), timed."""
    with SQLiteStore(path) as store:
        compare._fill_kit(Outbox(store, EventBus(), load_entry_points=False), events)
    with (
        SQLiteStore(path, migrate=False) as store,
        closing(compare._sqlite_connect(str(path))) as conn,
    ):
        q = store.dialect.queries
        timed = Timed(conn)
        while True:
            now = int(time.time() * 1_000_000)
            conn.execute("BEGIN IMMEDIATE")
            claim = {"now": now, "lease": 30_000_000, "batch_size": BATCH, "hold": True}
            rows = timed("claim", q["claim"], claim)
            timed("claim commit", "COMMIT")
            if not rows:
                return timed.timings
            conn.execute("BEGIN IMMEDIATE")
            kept = [
                (r[0], r[compare.TOKEN], compare.HANDLER, "succeeded", r[7], now, None)
                for r in rows
            ]
            timed("records", q["insert_records_fenced"], {"items": json.dumps(kept)})
            settle = {
                "now": now,
                "ids": json.dumps([r[0] for r in rows]),
                "tokens": json.dumps([r[compare.TOKEN] for r in rows]),
            }
            timed("settle", q["publish_many"], settle)
            timed("commit", "COMMIT")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[Timings]] = {"minimal loop": [], "outboxkit's statements": []}
    for _ in range(args.rounds):
        for label, run in (("minimal loop", minimal), ("outboxkit's statements", store_statements)):
            with tempfile.TemporaryDirectory(prefix="outboxkit-statements-") as tmp:
                runs[label].append(run(Path(tmp) / "bench.db", args.events))
    for label, timings in runs.items():
        names = list(timings[0])
        per_event = {n: median(t[n] for t in timings) * 1e6 / args.events for n in names}
        total = median(sum(t.values()) for t in timings) * 1e6 / args.events
        cells = ", ".join(f"{n} {v:.2f}" for n, v in per_event.items())
        print(f"{label}: {cells}; total {total:.2f} us per event")


if __name__ == "__main__":
    main()
