"""The client's CPU per event of one poller draining a backlog: for A/B runs of two checkouts.

Enqueues ``--events`` events, then drains them with one poller (``run_once`` until idle, in
batches of 100) and prints the wall time and this process's CPU time per event. Two shapes:

- ``sqlite`` (default): the blocking poller on a SQLite file, a transactional handler that
  writes one row of its own through ``ctx.connection`` (``--transaction per_event`` or
  ``per_batch``);
- ``pg-async``: the asyncio poller on PostgreSQL (a fresh schema, dropped afterwards), a no-op
  async handler, non-transactional, at ``--concurrency`` (16).

Not a throughput ratio (``compare.py`` is, against the hand-written loops): a measure of
outboxkit's own work, for comparing two versions of it on one machine. Run the old and new
checkouts alternately, each on ``PYTHONPATH``, and compare medians:

    for i in 1 2 3; do for v in ../old .; do PYTHONPATH=$v python bench/drain_cpu.py; done; done
    python bench/drain_cpu.py --transaction per_event --events 30000
    python bench/drain_cpu.py --shape pg-async --events 10000
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import fill_outbox, pg_schema, pg_url_default

from outboxkit import EventBus, Outbox
from outboxkit.poller import ThreadWaiter
from outboxkit.waiter import LoopWaiter

TOPIC = "bench.drain"
ROW = "INSERT INTO app_rows (event_id, written_at) VALUES (?, ?)"


def fill(outbox: Any, events: int) -> None:
    fill_outbox(outbox, TOPIC, events)


def sqlite_drain(events: int, transaction: str) -> tuple[float, float, int]:
    from outboxkit_sqlite import SQLiteStore

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "drain.db"
        with SQLiteStore(path) as store:
            with sqlite3.connect(path) as conn:
                conn.execute(
                    "CREATE TABLE app_rows (event_id INTEGER PRIMARY KEY, written_at REAL)"
                )
            bus = EventBus()
            calls = [0]

            def handle(event: Any, ctx: Any) -> None:
                calls[0] += 1
                ctx.connection.execute(ROW, (event.id, time.time()))

            bus.subscribe(TOPIC, handle, name="app_rows", transactional=True)
            outbox = Outbox(store, bus, load_entry_points=False)
            fill(outbox, events)
            poller = outbox.poller(batch_size=100, waiter=ThreadWaiter(), transaction=transaction)
            store.stats(now=None)  # connected before the clock starts
            wall, cpu = time.perf_counter(), time.process_time()
            while poller.run_once():
                pass
            return time.perf_counter() - wall, time.process_time() - cpu, calls[0]


def pg_async_drain(url: str, events: int, concurrency: int) -> tuple[float, float, int]:
    from outboxkit_pg import PostgresStore

    with pg_schema(url, "outboxkit_drain") as schema:
        store = PostgresStore(url, schema=schema, notify=False, pool_max_size=concurrency + 2)
        try:
            store.migrate()
            bus = EventBus()
            calls = [0]

            async def handle(event: Any, ctx: Any) -> None:
                calls[0] += 1

            bus.subscribe(TOPIC, handle, name="noop", transactional=False)
            outbox = Outbox(store, bus, load_entry_points=False)
            fill(outbox, events)
            poller = outbox.async_poller(
                concurrency=concurrency, batch_size=100, waiter=LoopWaiter()
            )

            async def drain() -> tuple[float, float]:
                try:
                    async with poller.store.transaction():
                        pass  # a first connection, before the clock starts
                    wall, cpu = time.perf_counter(), time.process_time()
                    while await poller.run_once():
                        pass
                    return time.perf_counter() - wall, time.process_time() - cpu
                finally:
                    await poller.store.close()

            wall, cpu = asyncio.run(drain())
            return wall, cpu, calls[0]
        finally:
            store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--shape", choices=("sqlite", "pg-async"), default="sqlite")
    parser.add_argument("--events", type=int, default=30_000)
    parser.add_argument("--transaction", choices=("per_event", "per_batch"), default="per_batch")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--pg-url", default=pg_url_default())
    args = parser.parse_args()
    if args.events < 1 or args.concurrency < 1:
        parser.error("--events and --concurrency must be at least 1")
    if args.shape == "sqlite":
        wall, cpu, handled = sqlite_drain(args.events, args.transaction)
        what = f"SQLite {args.transaction}, handler writes a row"
    else:
        wall, cpu, handled = pg_async_drain(args.pg_url, args.events, args.concurrency)
        what = f"PG asyncio c={args.concurrency}, no-op handler"
    if handled != args.events:
        raise SystemExit(f"drained {handled} of {args.events} events")
    print(
        f"{what}: {args.events / wall:,.0f} ev/s, wall {wall / args.events * 1e6:.1f} µs/event, "
        f"CPU {cpu / args.events * 1e6:.1f} µs/event"
    )


if __name__ == "__main__":
    main()
