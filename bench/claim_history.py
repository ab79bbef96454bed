"""Claim cost against history (PostgreSQL): claim latency with 0 and with 1,000,000 published rows.

The events table holds ``--due`` due events. Each sample is one ``store.claim`` of a batch of
``--batch-size`` (timed), followed by a ``store.release`` of what it claimed (not timed), so the
due set stays the same. Measured first with no history, then after bulk-inserting
``--history`` published rows with ``generate_series`` in SQL and ``VACUUM ANALYZE``. Prints the
median and p90 of each and the ratio of the medians (history / none).

    python bench/claim_history.py
    python bench/claim_history.py --history 200000 --claims 100
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta

import psycopg
from _common import median, percentile, pg_schema, pg_url_default
from psycopg import sql

from outboxkit import EventBus, Outbox
from outboxkit_pg import PostgresStore

TOPIC = "bench.claim"
LEASE = timedelta(seconds=30)

HISTORY_SQL = """
INSERT INTO {}.outbox_events
       (topic, payload, headers, created_at, available_at, attempts, published_at)
SELECT 'bench.history', jsonb_build_object('n', g), '{{}}'::jsonb,
       now() - interval '2 days', now() - interval '2 days', 1,
       now() - interval '1 day' + g * interval '1 millisecond'
  FROM generate_series(1, %(n)s) AS g
"""


def sample(store: PostgresStore, args: argparse.Namespace) -> list[float]:
    ms: list[float] = []
    for _ in range(args.warmup + args.claims):
        started = time.perf_counter()
        claims = store.claim(batch_size=args.batch_size, lease=LEASE, now=None)
        ms.append((time.perf_counter() - started) * 1000)
        if len(claims) != min(args.batch_size, args.due):
            raise RuntimeError(f"claimed {len(claims)}, expected {args.batch_size}")
        store.release(claims, now=None)
    return ms[args.warmup :]


def vacuum(args: argparse.Namespace, schema: str) -> None:
    with psycopg.connect(args.pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("VACUUM ANALYZE {}.outbox_events").format(sql.Identifier(schema)))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--history", type=int, default=1_000_000, help="published rows")
    parser.add_argument("--due", type=int, default=1000, help="due rows")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--claims", type=int, default=300, help="timed claims per phase")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--pg-url", default=pg_url_default())
    args = parser.parse_args()
    with pg_schema(args.pg_url) as schema:
        store = PostgresStore(args.pg_url, schema=schema, notify=False)
        try:
            store.migrate()
            outbox = Outbox(store, EventBus(), load_entry_points=False)
            with store.transaction() as tx:
                outbox.enqueue_many(tx, [(TOPIC, {"n": i}) for i in range(args.due)])
            vacuum(args, schema)
            empty = sample(store, args)
            started = time.perf_counter()
            with psycopg.connect(args.pg_url, autocommit=True) as conn:
                conn.execute(
                    sql.SQL(HISTORY_SQL).format(sql.Identifier(schema)), {"n": args.history}
                )
            vacuum(args, schema)
            setup = time.perf_counter() - started
            full = sample(store, args)
        finally:
            store.close()
    print(
        f"claim of {args.batch_size} with {args.due} due rows, median of {args.claims} claims: "
        f"0 published rows {median(empty):.2f} ms (p90 {percentile(empty, 90):.2f}) | "
        f"{args.history} published rows {median(full):.2f} ms (p90 {percentile(full, 90):.2f}) "
        f"| ratio {median(full) / median(empty):.2f}x (history insert + VACUUM {setup:.1f} s)",
        flush=True,
    )


if __name__ == "__main__":
    main()
