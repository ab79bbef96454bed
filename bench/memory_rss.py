"""Memory: peak RSS of one poller draining 20,000 and 200,000 events.

For each size the parent prepares the events (SQLite: a temporary file; PostgreSQL: a fresh
schema, dropped afterwards), then a fresh child process (multiprocessing, spawn) opens the
store, drains everything with ``Poller.run_once`` (one transactional no-op handler) and reports
its peak RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss``, KiB on Linux) before and after the
drain. Prints each peak and the difference between the sizes in MB.

    python bench/memory_rss.py                       # SQLite
    python bench/memory_rss.py --backend pg --sizes 20000 50000
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import pg_schema, pg_url_default

TOPIC = "bench.memory"
TIMEOUT = 1200.0


def _child(backend: str, target: str, schema: str, results: Any) -> None:
    from outboxkit import Event, EventBus, Outbox
    from outboxkit.poller import ThreadWaiter

    store: Any
    if backend == "pg":
        from outboxkit_pg import PostgresStore

        store = PostgresStore(target, schema=schema, notify=False)
    else:
        from outboxkit_sqlite import SQLiteStore

        store = SQLiteStore(target, migrate=False)

    def noop(event: Event, ctx: Any) -> None:
        return None

    bus = EventBus()
    bus.subscribe(TOPIC, noop, name="noop")
    outbox = Outbox(store, bus, load_entry_points=False)
    poller = outbox.poller(waiter=ThreadWaiter())
    store.stats(now=None)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    delivered = 0
    while report := poller.run_once():
        delivered += len(report.published)
    elapsed = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    store.close()
    results.put((before, after, delivered, elapsed))


def _fill(outbox: Any, store: Any, n: int) -> None:
    for start in range(0, n, 1000):
        with store.transaction() as tx:
            outbox.enqueue_many(tx, [(TOPIC, {"n": i}) for i in range(start, min(start + 1000, n))])


def _drain_in_child(backend: str, target: str, schema: str) -> tuple[int, int, int, float]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_child, args=(backend, target, schema, results))
    proc.start()
    try:
        got: tuple[int, int, int, float] = results.get(timeout=TIMEOUT)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
            proc.join()
    return got


def measure(args: argparse.Namespace, n: int) -> tuple[int, int, int, float]:
    from outboxkit import EventBus, Outbox

    if args.backend == "pg":
        from outboxkit_pg import PostgresStore

        with pg_schema(args.pg_url) as schema:
            pg_store = PostgresStore(args.pg_url, schema=schema, notify=False)
            try:
                pg_store.migrate()
                _fill(Outbox(pg_store, EventBus(), load_entry_points=False), pg_store, n)
            finally:
                pg_store.close()
            return _drain_in_child("pg", args.pg_url, schema)
    from outboxkit_sqlite import SQLiteStore

    with tempfile.TemporaryDirectory(prefix="outboxkit-bench-") as root:
        path = str(Path(root) / "memory.db")
        store = SQLiteStore(path)
        try:
            _fill(Outbox(store, EventBus(), load_entry_points=False), store, n)
        finally:
            store.close()
        return _drain_in_child("sqlite", path, "")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[20_000, 200_000])
    parser.add_argument("--backend", choices=("sqlite", "pg"), default="sqlite")
    parser.add_argument("--pg-url", default=pg_url_default())
    args = parser.parse_args()
    peaks: list[tuple[int, float]] = []
    for n in args.sizes:
        before, after, delivered, elapsed = measure(args, n)
        peaks.append((n, after / 1024))
        print(
            f"{args.backend}, {n} events: peak RSS {after / 1024:.1f} MB "
            f"(before the drain {before / 1024:.1f} MB), {delivered} delivered in {elapsed:.1f} s",
            flush=True,
        )
    if len(peaks) >= 2:
        (n0, p0), (n1, p1) = peaks[0], peaks[-1]
        print(f"difference {n1} vs {n0} events: {p1 - p0:+.1f} MB", flush=True)


if __name__ == "__main__":
    main()
