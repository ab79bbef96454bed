"""Wake-up latency (PostgreSQL): from a producer's commit to the handler's start.

A producer commits ``--events`` events one by one at ``--rate`` per second, each in its own
transaction on its own connection and through an ``Outbox`` of its own (so no in-process wake-up
reaches the poller: only PostgreSQL's notification, or the poller's own polling, can). A poller
runs ``run_forever`` in a thread with

- ``notify``: the store's default waiter (``LISTEN`` on its own connection), and
- ``polling``: ``notify=False``, ``interval=0.5`` s: nothing but polling.

The latency of an event is the handler's ``time.perf_counter()`` at entry minus the producer's
right after ``commit()`` returned. Prints p50, p99 and max per mode.

    python bench/wakeup_latency.py
    python bench/wakeup_latency.py --events 100 --rate 50 --mode notify
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import psycopg
from _common import median, percentile, pg_schema, pg_url_default

from outboxkit import Event, EventBus, Outbox
from outboxkit_pg import PostgresStore

TOPIC = "bench.wakeup"


def measure(args: argparse.Namespace, *, notify: bool) -> list[float]:
    started_at: dict[int, float] = {}
    everything = threading.Event()

    def handler(event: Event, ctx: Any) -> None:
        started_at[event.id] = time.perf_counter()
        if len(started_at) >= args.events:
            everything.set()

    with pg_schema(args.pg_url) as schema:
        bus = EventBus()
        bus.subscribe(TOPIC, handler, name="stamp")
        store = PostgresStore(args.pg_url, schema=schema, notify=notify)
        producer_store = PostgresStore(args.pg_url, schema=schema, notify=notify)
        try:
            store.migrate()
            outbox = Outbox(store, bus, load_entry_points=False)
            producer = Outbox(producer_store, EventBus(), load_entry_points=False)
            poller = outbox.poller(interval=0.5)
            thread = threading.Thread(target=poller.run_forever, name="poller", daemon=True)
            thread.start()
            committed_at: dict[int, float] = {}
            try:
                with psycopg.connect(args.pg_url) as conn:
                    producer.enqueue(conn, "bench.warmup", {})  # connect, check schema
                    conn.commit()
                    time.sleep(1.0)  # the poller is listening by now
                    gap = 1.0 / args.rate
                    next_at = time.perf_counter()
                    for i in range(args.events):
                        pause = next_at - time.perf_counter()
                        if pause > 0:
                            time.sleep(pause)
                        next_at += gap
                        event_id = producer.enqueue(conn, TOPIC, {"n": i})
                        conn.commit()
                        committed_at[event_id] = time.perf_counter()
                if not everything.wait(timeout=30):
                    print(f"  WARNING: only {len(started_at)} of {args.events} delivered in time")
            finally:
                poller.stop()
                thread.join(timeout=30)
        finally:
            store.close()
            producer_store.close()
    return [(started_at[i] - committed_at[i]) * 1000 for i in committed_at if i in started_at]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--events", type=int, default=200)
    parser.add_argument("--rate", type=float, default=20.0, help="events per second")
    parser.add_argument("--mode", choices=("notify", "polling", "all"), default="all")
    parser.add_argument("--pg-url", default=pg_url_default())
    args = parser.parse_args()
    modes = ("notify", "polling") if args.mode == "all" else (args.mode,)
    for mode in modes:
        ms = measure(args, notify=mode == "notify")
        label = "notify (LISTEN waiter)" if mode == "notify" else "polling only (0.5 s)"
        print(
            f"{label}: {len(ms)} events at {args.rate:g}/s: p50 {median(ms):.2f} ms, "
            f"p99 {percentile(ms, 99):.2f} ms, max {max(ms, default=float('nan')):.2f} ms "
            "(producer commit -> handler start)",
            flush=True,
        )


if __name__ == "__main__":
    main()
