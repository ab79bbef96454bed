"""PG, retention in the partitioned layout against DELETE-based pruning, in one run.

Each layout gets its own schema holding ``--events`` published events (default 1,000,000), each
with its delivery record, all published an hour ago, and 2,000 due events enqueued after them.
Retention then removes the published ones: ``Outbox.purge(published_older_than=...)``, which in
today's layout deletes them page by page (``DELETE``, 1,000 a transaction, the pollers'
retention) and in the partitioned layout (``partition_size``, default 100,000) detaches and drops
the partitions holding only them. Meanwhile a prober claims 10 due events and releases them,
again and again: the claim's latency before (for ``--probe-seconds``), during and after the
retention (for ``--probe-seconds`` again), per layout. Printed: each retention's wall time, the
ratio of the two, the claim's p50/p99 in each phase and the rows left behind (dead tuples).
Then the claim's cost by the number of partitions it spans (``--sweep``).

    python bench/partition_retention.py [--pg-url URL] [--events 1000000]
                                        [--partition-size 100000] [--probe-seconds 5]

The reference is the same store's own ``DELETE``-based pruning, which is what retention does
in the other layout (the peers' pruning is a DELETE as well). Both run in the same command, one
after the other (the partitioned one first), on the same server. Bounded: the loads, the
retentions and the probes each end by themselves.
"""

from __future__ import annotations

import argparse
import threading
import time
from datetime import timedelta
from typing import Any

import psycopg
from _common import median, percentile, pg_schema, pg_url_default
from psycopg import sql

from outboxkit import EventBus, Outbox
from outboxkit_pg import PostgresStore

LOAD_CHUNK = 100_000
LIVE = 2_000
CLAIM = 10


def _load(store: PostgresStore, url: str, events: int) -> None:
    """``events`` events published an hour ago, each with one record, in chunks (the partitioned
    layout's maintenance makes the partitions ahead between them, as the pollers would)."""
    names = store.names
    insert_events = sql.SQL(
        "INSERT INTO {} (topic, payload, headers, created_at, available_at, attempts,"
        " published_at) SELECT 'bench.old', jsonb_build_object('n', g), '{{}}'::jsonb,"
        " now() - interval '2 hours', now() - interval '2 hours', 1, now() - interval '1 hour'"
        " FROM generate_series(1, %(n)s) AS g RETURNING id"
    ).format(sql.Identifier(names.schema, names.events))
    insert_records = sql.SQL(
        "INSERT INTO {} (event_id, handler, outcome, attempt, recorded_at)"
        " SELECT i, 'h', 'succeeded', 1, now() - interval '1 hour' FROM unnest(%(ids)s::bigint[]) i"
    ).format(sql.Identifier(names.schema, names.deliveries))
    with psycopg.connect(url, autocommit=True) as conn:
        left = events
        while left:
            n = min(LOAD_CHUNK, left)
            if store.partition_size is not None:
                store.maintain_partitions()
            with conn.transaction():
                ids = [r[0] for r in conn.execute(insert_events, {"n": n}).fetchall()]
                conn.execute(insert_records, {"ids": ids})
            left -= n
        conn.execute(
            sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(names.schema, names.events))
        )
        conn.execute(
            sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(names.schema, names.deliveries))
        )


class Prober:
    """Claims ``CLAIM`` due events and releases them, in a loop, timing each claim."""

    def __init__(self, store: PostgresStore) -> None:
        self.store = store
        self.samples: list[tuple[float, float]] = []  # (when, claim seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            claims = self.store.claim(batch_size=CLAIM, lease=timedelta(seconds=30), now=None)
            took = time.perf_counter() - started
            self.samples.append((started, took))
            self.store.release(claims, now=None)

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def between(self, start: float, end: float) -> list[float]:
        return [took for at, took in self.samples if start <= at < end]


def _dead_rows(url: str, store: PostgresStore) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_force_next_flush()")
        row = conn.execute(
            "SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables WHERE schemaname = %s",
            (store.names.schema,),
        ).fetchone()
    return int(row[0]) if row else 0


def run(url: str, events: int, partition_size: int | None, probe: float) -> dict[str, Any]:
    with pg_schema(url) as schema:
        store = PostgresStore(url, schema=schema, partition_size=partition_size, pool_max_size=4)
        try:
            store.migrate()
            _load(store, url, events)
            outbox = Outbox(store, EventBus(), load_entry_points=False)
            if partition_size is not None:
                store.maintain_partitions()
            with store.transaction() as tx:
                outbox.enqueue_many(tx, [("bench.live", n) for n in range(LIVE)])
            with Prober(store) as prober:
                before = time.perf_counter()
                time.sleep(probe)  # the prober's "before" phase (a benchmark, not a test)
                started = time.perf_counter()
                removed = outbox.purge(published_older_than=timedelta(minutes=30))
                ended = time.perf_counter()
                time.sleep(probe)
                after = time.perf_counter()
            assert store.stats(now=None).pending == LIVE
            return {
                "seconds": ended - started,
                "removed": removed,
                "before": prober.between(before, started),
                "during": prober.between(started, ended),
                "after": prober.between(ended, after),
                "dead_rows": _dead_rows(url, store),
            }
        finally:
            store.close()


def claim_by_partitions(url: str, counts: list[int]) -> list[tuple[str, float]]:
    """The claim's median (10 of 2,000 due events, then released) with the events table in
    today's layout, and partitioned with ``count`` finished partitions of 1,000 ids below the
    live one (plus the ones ahead): what each partition costs a claim."""
    found = []
    for count in [0, *counts]:
        with pg_schema(url) as schema:
            size = None if count == 0 else 1000
            store = PostgresStore(url, schema=schema, partition_size=size)
            try:
                store.migrate()
                if size is not None:  # ids as if count partitions had filled up
                    with psycopg.connect(url, autocommit=True) as conn:
                        seq = sql.Identifier(schema, "outbox_events_id_seq").as_string(conn)
                        conn.execute("SELECT setval(%s, %s)", (seq, count * size))
                    store.maintain_partitions()
                outbox = Outbox(store, EventBus(), load_entry_points=False)
                with store.transaction() as tx:
                    outbox.enqueue_many(tx, [("bench.live", n) for n in range(LIVE)])
                took = []
                for _ in range(600):
                    started = time.perf_counter()
                    claims = store.claim(batch_size=CLAIM, lease=timedelta(seconds=30), now=None)
                    took.append(time.perf_counter() - started)
                    store.release(claims, now=None)
                name = "today's layout" if size is None else f"{count} partitions below"
                found.append((name, median(took[100:])))
            finally:
                store.close()
    return found


def _ms(samples: list[float]) -> str:
    if not samples:
        return "no claim"
    return f"p50 {median(samples) * 1000:6.2f} ms, p99 {percentile(samples, 99) * 1000:6.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg-url", default=pg_url_default())
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--partition-size", type=int, default=100_000)
    parser.add_argument("--probe-seconds", type=float, default=5.0)
    parser.add_argument(
        "--sweep",
        default="1,5,15,40",
        help="finished partitions below the live one, for the "
        "claim's cost per partition ('' skips it)",
    )
    args = parser.parse_args()
    results = {
        "partitioned": run(args.pg_url, args.events, args.partition_size, args.probe_seconds),
        "delete": run(args.pg_url, args.events, None, args.probe_seconds),
    }
    print(
        f"retention of {args.events:,} published events (each with its record), "
        f"{LIVE:,} due events claimed {CLAIM} at a time meanwhile"
    )
    for name, r in results.items():
        print(
            f"{name:>11}: {r['seconds']:8.2f} s, {r['removed']:,} removed, {r['dead_rows']:,} "
            "dead rows left"
        )
        for phase in ("before", "during", "after"):
            print(f"{'':>13}claim {phase:>6}: {_ms(r[phase])} ({len(r[phase])} claims)")
    ratio = results["delete"]["seconds"] / results["partitioned"]["seconds"]
    print(f"DELETE-based pruning / dropping partitions: {ratio:.1f}x the time")
    if args.sweep:
        sweep = claim_by_partitions(args.pg_url, [int(n) for n in args.sweep.split(",")])
        base = sweep[0][1]
        print("the claim of 10 (median of 500), by the partitions it spans:")
        for name, took in sweep:
            print(f"{name:>24}: {took * 1000:5.2f} ms ({took / base:.2f}x today's layout)")


if __name__ == "__main__":
    main()
