"""Profile the per-event hot path on PostgreSQL with cProfile.

Enqueues ``--events`` events into a fresh schema (dropped afterwards), then drains them in this
process with ``Poller.run_once`` under cProfile (one transactional handler doing one ledger
insert through ``ctx.connection``, or with ``--noop`` one that never takes it) and prints the top
``--top`` functions by own time (tottime), plus the events/s seen under the profiler.

    python bench/profile_hot_path.py
    python bench/profile_hot_path.py --events 5000 --top 25 --sort cumulative
    python bench/profile_hot_path.py --transaction per_batch
    python bench/profile_hot_path.py --transaction per_batch --noop --events 20000
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from typing import Any

import psycopg
from _common import pg_schema, pg_url_default
from psycopg import sql

from outboxkit import Event, EventBus, Outbox
from outboxkit.poller import ThreadWaiter
from outboxkit_pg import PostgresStore

TOPIC = "bench.profile"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--events", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--sort", default="tottime", choices=("tottime", "cumulative"))
    parser.add_argument("--transaction", default="per_event", choices=("per_event", "per_batch"))
    parser.add_argument(
        "--noop", action="store_true", help="the handler never takes ctx.connection"
    )
    parser.add_argument("--pg-url", default=pg_url_default())
    args = parser.parse_args()
    with pg_schema(args.pg_url) as schema:
        with psycopg.connect(args.pg_url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("CREATE TABLE {}.ledger (event_id bigint, n bigint)").format(
                    sql.Identifier(schema)
                )
            )
        ledger_sql = sql.SQL("INSERT INTO {}.ledger (event_id, n) VALUES (%s, %s)").format(
            sql.Identifier(schema)
        )

        def ledger(event: Event, ctx: Any) -> None:
            if not args.noop:
                ctx.connection.execute(ledger_sql, (event.id, event.payload["n"]))

        bus = EventBus()
        bus.subscribe(TOPIC, ledger, name="ledger")
        store = PostgresStore(args.pg_url, schema=schema, notify=False)
        try:
            store.migrate()
            outbox = Outbox(store, bus, load_entry_points=False)
            for start in range(0, args.events, 1000):
                with store.transaction() as tx:
                    outbox.enqueue_many(
                        tx,
                        [(TOPIC, {"n": i}) for i in range(start, min(start + 1000, args.events))],
                    )
            poller = outbox.poller(
                batch_size=args.batch_size, waiter=ThreadWaiter(), transaction=args.transaction
            )
            profiler = cProfile.Profile()
            delivered = 0
            started = time.perf_counter()
            profiler.enable()
            while report := poller.run_once():
                delivered += len(report.published)
            profiler.disable()
            elapsed = time.perf_counter() - started
        finally:
            store.close()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats(args.sort).print_stats(args.top)
    print(
        f"profiled drain: {delivered} events in {elapsed:.2f} s "
        f"({delivered / elapsed:.0f} events/s under cProfile), top {args.top} by {args.sort}:"
    )
    print(out.getvalue())
    print(f"own time per event, by package (of {delivered} events):")
    for package, seconds in _by_package(stats).items():
        print(f"  {package:<32} {seconds / max(delivered, 1) * 1e6:8.1f} us")


def _by_package(stats: pstats.Stats) -> dict[str, float]:
    """Own (tottime) seconds grouped: outboxkit's packages, psycopg's blocking wait (mostly the
    server and the network), the rest of psycopg, psycopg_pool, and everything else."""
    totals: dict[str, float] = {}
    raw: dict[tuple[str, int, str], tuple[Any, ...]] = stats.stats  # type: ignore[attr-defined]
    for (path, _line, function), (_cc, _nc, tottime, _ct, _callers) in raw.items():
        if "psycopg_pool" in path:
            package = "psycopg_pool"
        elif "psycopg" in path and function == "wait":
            package = "psycopg Connection.wait (blocking)"
        elif "psycopg" in path:
            package = "psycopg (the rest)"
        elif "outboxkit" in path:
            package = "outboxkit"
        else:
            package = "other (stdlib, builtins, the handler)"
        totals[package] = totals.get(package, 0.0) + tottime
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


if __name__ == "__main__":
    main()
