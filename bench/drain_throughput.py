"""Drain throughput: outboxkit pollers against a hand-written loop of the same shape.

N pre-enqueued events, one transactional handler doing one ledger insert through
``ctx.connection``. Each poller process (multiprocessing, spawn) runs ``Poller.run_once`` until a
claim comes back empty. The floor, measured in the same run on tables of its own, is a minimal
psycopg / sqlite3 loop with the same transaction shape: claim a batch (PostgreSQL: a
``FOR UPDATE SKIP LOCKED`` CTE; SQLite: ``BEGIN IMMEDIATE`` + ``UPDATE ... RETURNING``), then per
event: begin, token check (``SELECT ... FOR UPDATE`` on PostgreSQL), one ledger insert, one
delivery-row insert, commit; then settle the whole batch in one statement. For the per_batch
mode the floor runs the whole batch in one transaction instead (per event a savepoint, token
check, ledger insert, delivery-row insert, release; then the settle; one commit), the same shape
as outboxkit's ``transaction="per_batch"``.

    python bench/drain_throughput.py                          # PG 1 and 2 pollers, SQLite 1
    python bench/drain_throughput.py --backend sqlite --events 5000
    python bench/drain_throughput.py --mode per_event         # skip the per_batch lines
    python bench/drain_throughput.py --repeat 3               # and each one's median ratio

Prints events/s for outboxkit and for the floor, and the ratio outboxkit / floor.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sqlite3
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

from _common import median, pg_schema, pg_url_default

TOPIC = "bench.drain"
HANDLER = "ledger"
MODES = ("per_event", "per_batch")
TIMEOUT = 600.0  # seconds a whole measurement may take before it is abandoned

# -- the floor's own tables and statements ------------------------------------------------------

PG_FLOOR_DDL = """
CREATE TABLE {s}.floor_events (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic text NOT NULL,
    payload jsonb NOT NULL,
    available_at timestamptz NOT NULL DEFAULT now(),
    attempts integer NOT NULL DEFAULT 0,
    locked_until timestamptz,
    token uuid,
    published_at timestamptz
) WITH (
    fillfactor = 80,
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02
);
CREATE INDEX ON {s}.floor_events (available_at, id) WHERE published_at IS NULL;
CREATE TABLE {s}.floor_deliveries (
    event_id bigint NOT NULL REFERENCES {s}.floor_events (id),
    handler text NOT NULL,
    attempt integer NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (event_id, handler)
);
CREATE TABLE {s}.floor_ledger (event_id bigint NOT NULL, n bigint NOT NULL);
CREATE TABLE {s}.ledger (event_id bigint NOT NULL, n bigint NOT NULL);
"""

PG_FLOOR_FILL = """
INSERT INTO {s}.floor_events (topic, payload)
SELECT %(topic)s, jsonb_build_object('n', g) FROM generate_series(1, %(n)s) AS g
"""

PG_FLOOR_CLAIM = """
WITH due AS MATERIALIZED (
    SELECT id FROM {s}.floor_events
     WHERE published_at IS NULL AND available_at <= now()
       AND (locked_until IS NULL OR locked_until <= now())
     ORDER BY available_at, id
     LIMIT %(batch)s
       FOR UPDATE SKIP LOCKED
)
UPDATE {s}.floor_events AS e
   SET locked_until = now() + interval '30 seconds', attempts = e.attempts + 1,
       token = gen_random_uuid()
  FROM due WHERE e.id = due.id
RETURNING e.id, e.token::text, e.attempts, e.payload::text
"""

PG_FLOOR_LOCK = """
SELECT id FROM {s}.floor_events
 WHERE id = %(id)s AND token = %(token)s::uuid AND published_at IS NULL
   FOR UPDATE
"""

PG_FLOOR_LEDGER = "INSERT INTO {s}.floor_ledger (event_id, n) VALUES (%(id)s, %(n)s)"

PG_FLOOR_RECORD = """
INSERT INTO {s}.floor_deliveries (event_id, handler, attempt)
VALUES (%(id)s, %(handler)s, %(attempt)s)
"""

PG_FLOOR_SETTLE = """
UPDATE {s}.floor_events AS e
   SET published_at = now(), locked_until = NULL, token = NULL
  FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[]) AS c (id, token)
 WHERE e.id = c.id AND e.token = c.token
"""

SQLITE_FLOOR_DDL = """
CREATE TABLE floor_events (
    id INTEGER PRIMARY KEY,
    topic TEXT NOT NULL,
    payload TEXT NOT NULL,
    available_at INTEGER NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    locked_until INTEGER,
    token TEXT,
    published_at INTEGER
);
CREATE INDEX floor_due ON floor_events (available_at, id) WHERE published_at IS NULL;
CREATE TABLE floor_deliveries (
    event_id INTEGER NOT NULL REFERENCES floor_events (id),
    handler TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    recorded_at INTEGER NOT NULL,
    PRIMARY KEY (event_id, handler)
);
CREATE TABLE floor_ledger (event_id INTEGER NOT NULL, n INTEGER NOT NULL);
CREATE TABLE ledger (event_id INTEGER NOT NULL, n INTEGER NOT NULL);
"""

SQLITE_FLOOR_CLAIM = """
UPDATE floor_events
   SET attempts = attempts + 1, locked_until = :lease_end, token = lower(hex(randomblob(16)))
 WHERE id IN (SELECT id FROM floor_events
               WHERE published_at IS NULL AND available_at <= :now
                 AND (locked_until IS NULL OR locked_until <= :now)
               ORDER BY available_at, id LIMIT :batch)
RETURNING id, token, attempts, payload
"""

SQLITE_FLOOR_OWNED = """
SELECT 1 FROM floor_events WHERE id = ? AND token = ? AND published_at IS NULL
"""
SQLITE_FLOOR_SETTLE = """
UPDATE floor_events SET published_at = :now, locked_until = NULL, token = NULL
 WHERE id IN (SELECT value FROM json_each(:ids))
"""


def _pg(statement: str, schema: str) -> Any:
    """``statement`` with ``{s}`` filled in by the schema, quoted as an identifier."""
    from psycopg import sql

    return sql.SQL(statement).format(s=sql.Identifier(schema))


def _us() -> int:
    return time.time_ns() // 1000


# -- workers (run in spawned processes) ---------------------------------------------------------


@dataclass(frozen=True)
class Job:
    backend: str  # "pg" | "sqlite"
    kind: str  # "outboxkit" | "floor"
    target: str  # PG URL or SQLite file path
    schema: str  # PG schema ("" for SQLite)
    batch_size: int
    mode: str  # "per_event" | "per_batch"


def _outboxkit_worker(job: Job, barrier: Barrier, results: Any) -> None:
    from outboxkit import Event, EventBus, Outbox
    from outboxkit.poller import ThreadWaiter

    bus = EventBus()
    if job.backend == "pg":
        from psycopg import sql

        from outboxkit_pg import PostgresStore

        store: Any = PostgresStore(job.target, schema=job.schema, notify=False)
        ledger_sql: Any = sql.SQL("INSERT INTO {}.ledger (event_id, n) VALUES (%s, %s)").format(
            sql.Identifier(job.schema)
        )
    else:
        from outboxkit_sqlite import SQLiteStore

        store = SQLiteStore(job.target, migrate=False)
        ledger_sql = "INSERT INTO ledger (event_id, n) VALUES (?, ?)"

    def ledger(event: Event, ctx: Any) -> None:
        ctx.connection.execute(ledger_sql, (event.id, event.payload["n"]))

    bus.subscribe(TOPIC, ledger, name=HANDLER)
    outbox = Outbox(store, bus, load_entry_points=False)
    poller = outbox.poller(batch_size=job.batch_size, waiter=ThreadWaiter(), transaction=job.mode)
    store.stats(now=None)  # connect (and check the schema) before the clock starts
    barrier.wait()
    started = time.monotonic()
    delivered = 0
    while report := poller.run_once():
        delivered += len(report.published)
    results.put((started, time.monotonic(), delivered))
    store.close()


def _pg_floor_worker(job: Job, barrier: Barrier, results: Any) -> None:
    import psycopg

    claim, lock = _pg(PG_FLOOR_CLAIM, job.schema), _pg(PG_FLOOR_LOCK, job.schema)
    insert_ledger, record = _pg(PG_FLOOR_LEDGER, job.schema), _pg(PG_FLOOR_RECORD, job.schema)
    settle = _pg(PG_FLOOR_SETTLE, job.schema)
    conn = psycopg.connect(job.target, autocommit=True)
    barrier.wait()
    started = time.monotonic()
    delivered = 0
    while True:
        rows = conn.execute(claim, {"batch": job.batch_size}).fetchall()
        if not rows:
            break
        done_ids: list[int] = []
        done_tokens: list[str] = []
        batch = conn.transaction() if job.mode == "per_batch" else contextlib.nullcontext()
        with batch:
            # per_event: each "with" is a transaction; per_batch: a savepoint of the batch's.
            for event_id, token, attempt, payload in rows:
                with conn.transaction():
                    if conn.execute(lock, {"id": event_id, "token": token}).fetchone() is None:
                        continue
                    n = json.loads(payload)["n"]
                    conn.execute(insert_ledger, {"id": event_id, "n": n})
                    conn.execute(record, {"id": event_id, "handler": HANDLER, "attempt": attempt})
                done_ids.append(event_id)
                done_tokens.append(token)
            conn.execute(settle, {"ids": done_ids, "tokens": done_tokens})
        delivered += len(done_ids)
    results.put((started, time.monotonic(), delivered))
    conn.close()


def _sqlite_floor_worker(job: Job, barrier: Barrier, results: Any) -> None:
    conn = sqlite3.connect(job.target, isolation_level=None, timeout=30)
    conn.execute("PRAGMA synchronous=NORMAL")
    barrier.wait()
    started = time.monotonic()
    delivered = 0
    while True:
        now = _us()
        conn.execute("BEGIN IMMEDIATE")
        rows = conn.execute(
            SQLITE_FLOOR_CLAIM,
            {"now": now, "lease_end": now + 30_000_000, "batch": job.batch_size},
        ).fetchall()
        conn.execute("COMMIT")
        if not rows:
            break
        done: list[int] = []
        batched = job.mode == "per_batch"
        # per_event: a transaction per event; per_batch: one per batch, a savepoint per event.
        begin, commit, rollback = (
            ("SAVEPOINT e", "RELEASE e", "ROLLBACK TO e")
            if batched
            else ("BEGIN IMMEDIATE", "COMMIT", "ROLLBACK")
        )
        if batched:
            conn.execute("BEGIN IMMEDIATE")
        for event_id, token, attempt, payload in rows:
            conn.execute(begin)
            if conn.execute(SQLITE_FLOOR_OWNED, (event_id, token)).fetchone() is None:
                conn.execute(rollback)
                continue
            n = json.loads(payload)["n"]
            conn.execute("INSERT INTO floor_ledger (event_id, n) VALUES (?, ?)", (event_id, n))
            conn.execute(
                "INSERT INTO floor_deliveries (event_id, handler, attempt, recorded_at)"
                " VALUES (?, ?, ?, ?)",
                (event_id, HANDLER, attempt, _us()),
            )
            conn.execute(commit)
            done.append(event_id)
        if not batched:
            conn.execute("BEGIN IMMEDIATE")
        conn.execute(SQLITE_FLOOR_SETTLE, {"now": _us(), "ids": json.dumps(done)})
        conn.execute("COMMIT")
        delivered += len(done)
    results.put((started, time.monotonic(), delivered))
    conn.close()


def _worker(job: Job, barrier: Barrier, results: Any) -> None:
    if job.kind == "outboxkit":
        _outboxkit_worker(job, barrier, results)
    elif job.backend == "pg":
        _pg_floor_worker(job, barrier, results)
    else:
        _sqlite_floor_worker(job, barrier, results)


def run_pollers(job: Job, processes: int) -> tuple[float, int]:
    """Run ``processes`` workers together; (seconds from the first start to the last end, events)."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(processes, timeout=120)
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(job, barrier, results)) for _ in range(processes)]
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=TIMEOUT) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a poller process failed: exit codes {[p.exitcode for p in procs]}")
    started = min(g[0] for g in got)
    ended = max(g[1] for g in got)
    return ended - started, sum(g[2] for g in got)


# -- backends -----------------------------------------------------------------------------------


def _report(label: str, n: int, kit: tuple[float, int], floor: tuple[float, int]) -> float:
    """Print one configuration's figures; its ratio outboxkit / floor."""
    kit_rate = kit[1] / kit[0]
    floor_rate = floor[1] / floor[0]
    print(
        f"{label}: outboxkit {kit_rate:8.0f} events/s ({kit[1]} in {kit[0]:.2f} s) | "
        f"floor {floor_rate:8.0f} events/s ({floor[1]} in {floor[0]:.2f} s) | "
        f"ratio {kit_rate / floor_rate:.2f}x",
        flush=True,
    )
    if kit[1] != n or floor[1] != n:
        print(f"  WARNING: expected {n} deliveries each, got {kit[1]} and {floor[1]}")
    return kit_rate / floor_rate


def bench_pg(args: argparse.Namespace, processes: int, mode: str) -> tuple[str, float]:
    import psycopg

    from outboxkit import EventBus, Outbox
    from outboxkit_pg import PostgresStore

    with pg_schema(args.pg_url) as schema:
        store = PostgresStore(args.pg_url, schema=schema, notify=False)
        try:
            store.migrate()
            outbox = Outbox(store, EventBus(), load_entry_points=False)
            with psycopg.connect(args.pg_url, autocommit=True) as conn:
                conn.execute(_pg(PG_FLOOR_DDL, schema))
                conn.execute(_pg(PG_FLOOR_FILL, schema), {"topic": TOPIC, "n": args.events})
            for start in range(0, args.events, 1000):
                with store.transaction() as tx:
                    outbox.enqueue_many(
                        tx,
                        [(TOPIC, {"n": i}) for i in range(start, min(start + 1000, args.events))],
                    )
            with psycopg.connect(args.pg_url, autocommit=True) as conn:
                conn.execute(_pg("VACUUM ANALYZE {s}.outbox_events", schema))
                conn.execute(_pg("VACUUM ANALYZE {s}.floor_events", schema))
        finally:
            store.close()
        floor = run_pollers(
            Job("pg", "floor", args.pg_url, schema, args.batch_size, mode), processes
        )
        kit = run_pollers(
            Job("pg", "outboxkit", args.pg_url, schema, args.batch_size, mode), processes
        )
        with psycopg.connect(args.pg_url, autocommit=True) as conn:
            row = conn.execute(_pg("SELECT count(*) FROM {s}.ledger", schema)).fetchone()
            ledger_rows = row[0] if row else 0
        label = f"pg {mode}, {processes} poller{'s' if processes > 1 else ''}"
        ratio = _report(label, args.events, kit, floor)
        if ledger_rows != args.events:
            print(f"  WARNING: ledger has {ledger_rows} rows, expected {args.events}")
        return label, ratio


def bench_sqlite(args: argparse.Namespace, mode: str) -> tuple[str, float]:
    from outboxkit import EventBus, Outbox
    from outboxkit_sqlite import SQLiteStore

    with tempfile.TemporaryDirectory(prefix="outboxkit-bench-") as root:
        path = str(Path(root) / "drain.db")
        store = SQLiteStore(path)
        try:
            outbox = Outbox(store, EventBus(), load_entry_points=False)
            for start in range(0, args.events, 1000):
                with store.transaction() as tx:
                    outbox.enqueue_many(
                        tx,
                        [(TOPIC, {"n": i}) for i in range(start, min(start + 1000, args.events))],
                    )
        finally:
            store.close()
        conn = sqlite3.connect(path, isolation_level=None)
        try:
            conn.executescript(SQLITE_FLOOR_DDL)
            now = _us()
            conn.execute("BEGIN")
            conn.executemany(
                "INSERT INTO floor_events (topic, payload, available_at) VALUES (?, ?, ?)",
                ((TOPIC, json.dumps({"n": i}), now) for i in range(args.events)),
            )
            conn.execute("COMMIT")
            conn.execute("ANALYZE")
        finally:
            conn.close()
        floor = run_pollers(Job("sqlite", "floor", path, "", args.batch_size, mode), 1)
        kit = run_pollers(Job("sqlite", "outboxkit", path, "", args.batch_size, mode), 1)
        conn = sqlite3.connect(path)
        try:
            ledger_rows = conn.execute("SELECT count(*) FROM ledger").fetchone()[0]
        finally:
            conn.close()
        label = f"sqlite {mode}, 1 poller"
        ratio = _report(label, args.events, kit, floor)
        if ledger_rows != args.events:
            print(f"  WARNING: ledger has {ledger_rows} rows, expected {args.events}")
        return label, ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--backend", choices=("pg", "sqlite", "all"), default="all")
    parser.add_argument("--mode", choices=(*MODES, "all"), default="all")
    parser.add_argument("--pg-url", default=pg_url_default())
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every configuration this many times and end with each one's median ratio",
    )
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    print(
        f"drain throughput: {args.events} events, batch size {args.batch_size}, "
        f"one transactional handler (one insert); pid {os.getpid()}",
        flush=True,
    )
    modes = MODES if args.mode == "all" else (args.mode,)
    ratios: dict[str, list[float]] = {}
    for _ in range(args.repeat):
        for mode in modes:
            runs: list[tuple[str, float]] = []
            if args.backend in ("pg", "all"):
                runs += [bench_pg(args, 1, mode), bench_pg(args, 2, mode)]
            if args.backend in ("sqlite", "all"):
                runs.append(bench_sqlite(args, mode))
            for label, ratio in runs:
                ratios.setdefault(label, []).append(ratio)
    if args.repeat > 1:
        print(f"median ratio of {args.repeat} runs each:")
        for label, values in ratios.items():
            spread = ", ".join(f"{v:.2f}" for v in values)
            print(f"  {label}: {median(values):.2f}x ({spread})")


if __name__ == "__main__":
    main()
