"""Cost of per-key ordering (R15): keyed claim latency and keyed drain throughput vs unkeyed.

Claim: two events tables of the same size, ``--due`` due events each (default 100,000): one
keyed (``--keys`` keys, 10,000 by default, ``due / keys`` events each, enqueued interleaved so
every key's events are spread over the table), one without keys. Each sample is one
``store.claim`` of ``--batch-size`` (timed), followed by a ``store.release`` of what it claimed
(not timed), so the due set stays the same. Rounds alternate which table goes first; the
medians and the ratio keyed / unkeyed are printed (target <= 1.5x). A third table holds the
same keyed events clustered (each key's events consecutive by id), the case where the claim
walks past the most blocked events.

Drain: ``--drain`` events (10 per key, interleaved) enqueued, then drained by one blocking
poller (``run_once`` until empty) to a no-op transactional handler, timed; the same number of
unkeyed events in another table; alternating rounds; events/s medians and the ratio keyed /
unkeyed (target >= 0.8x).

PostgreSQL first, then SQLite (a file in a temporary directory) as a second table.

    python bench/ordering.py
    python bench/ordering.py --quick            # 10,000 due events, 1,000 keys, 2 rounds
    python bench/ordering.py --backend pg --explain
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
from _common import median, pg_schema, pg_url_default
from psycopg import sql

from outboxkit import Event, EventBus, Message, Outbox
from outboxkit_pg import PostgresStore
from outboxkit_sqlite import SQLiteStore

TOPIC = "bench.ordering"
LEASE = timedelta(seconds=30)
CHUNK = 1000  # events per enqueue transaction while filling

Layout = Callable[[int, int], str | None]


def interleaved(n: int, keys: int) -> str | None:
    return f"key-{n % keys}"


def clustered(per_key: int) -> Layout:
    return lambda n, keys: f"key-{n // per_key}"


def unkeyed(n: int, keys: int) -> str | None:
    return None


def fill(store: Any, count: int, keys: int, layout: Layout) -> None:
    """``count`` due events through the store's own enqueue (so keys are numbered as in use)."""
    outbox = Outbox(store, EventBus(), load_entry_points=False)
    for start in range(0, count, CHUNK):
        with store.transaction() as tx:
            outbox.enqueue_many(
                tx,
                [
                    Message(TOPIC, {"n": n}, key=layout(n, keys))
                    for n in range(start, min(count, start + CHUNK))
                ],
            )


def claim_ms(store: Any, batch_size: int, claims: int) -> list[float]:
    ms: list[float] = []
    for _ in range(claims):
        started = time.perf_counter()
        got = store.claim(batch_size=batch_size, lease=LEASE, now=None)
        ms.append((time.perf_counter() - started) * 1000)
        if len(got) != batch_size:
            raise RuntimeError(f"claimed {len(got)}, expected {batch_size}")
        store.release(got, now=None)
    return ms


def drain_rate(store: Any, count: int, keys: int, layout: Layout) -> float:
    """Events/s of one poller draining ``count`` fresh events to a no-op handler."""
    fill(store, count, keys, layout)
    bus = EventBus()

    def noop(event: Event, ctx: Any) -> None:
        pass

    bus.subscribe(TOPIC, noop, name="noop")
    poller = Outbox(store, bus, load_entry_points=False).poller(batch_size=100, lease=LEASE)
    done = 0
    started = time.perf_counter()
    while done < count:
        got = len(poller.run_once().claimed)
        if not got:
            raise RuntimeError(f"drain stalled at {done} of {count}")
        done += got
    return count / (time.perf_counter() - started)


def alternate(rounds: int, sides: dict[str, Callable[[], list[float]]]) -> dict[str, list[float]]:
    """Run each side once per round, the order rotated every round; all samples per side."""
    names = list(sides)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].extend(sides[name]())
    return samples


def report(label: str, args: argparse.Namespace, stores: dict[str, Any]) -> None:
    claim = alternate(
        args.rounds,
        {
            name: functools.partial(claim_ms, s, args.batch_size, args.claims)
            for name, s in stores.items()
        },
    )
    base = median(claim["unkeyed"])
    print(
        f"{label} claim of {args.batch_size}, {args.due} due events, {args.keys} keys, median of"
        f" {args.rounds} x {args.claims}: unkeyed {base:.2f} ms | "
        + " | ".join(
            f"{name} {median(ms):.2f} ms ({median(ms) / base:.2f}x)"
            for name, ms in claim.items()
            if name != "unkeyed"
        ),
        flush=True,
    )


def drains(label: str, args: argparse.Namespace, open_store: Callable[[], Any]) -> None:
    keys = max(1, args.drain // 10)

    def side(layout: Layout) -> Callable[[], list[float]]:
        def run() -> list[float]:
            with closing_store(open_store()) as store:
                return [drain_rate(store, args.drain, keys, layout)]

        return run

    rates = alternate(args.rounds, {"unkeyed": side(unkeyed), "keyed": side(interleaved)})
    base = median(rates["unkeyed"])
    keyed = median(rates["keyed"])
    print(
        f"{label} drain of {args.drain} events ({keys} keys, 10 each), one poller, median of"
        f" {args.rounds}: unkeyed {base:.0f} ev/s | keyed {keyed:.0f} ev/s"
        f" ({keyed / base:.2f}x)",
        flush=True,
    )


@contextmanager
def closing_store(store: Any) -> Iterator[Any]:
    try:
        yield store
    finally:
        store.close()


def layouts(args: argparse.Namespace) -> dict[str, Layout]:
    return {
        "unkeyed": unkeyed,
        "keyed": interleaved,
        "keyed-clustered": clustered(max(1, args.due // args.keys)),
    }


def run_pg(args: argparse.Namespace) -> None:
    with ExitStack() as stack:
        stores: dict[str, Any] = {}
        for name, layout in layouts(args).items():
            schema = stack.enter_context(pg_schema(args.pg_url))
            store = stack.enter_context(
                closing_store(PostgresStore(args.pg_url, schema=schema, notify=False))
            )
            store.migrate()
            fill(store, args.due, args.keys, layout)
            with store.transaction() as tx:
                tx.execute(sql.SQL("ANALYZE {}.outbox_events").format(sql.Identifier(schema)))
            stores[name] = store
        if args.explain:
            for name in ("keyed", "keyed-clustered"):
                print(f"-- the {name} claim's plan", flush=True)
                explain(stores[name], args.pg_url)
        report("PG", args, stores)

    def fresh() -> Any:
        # A schema per drain round, dropped with the bench's other schemas at the end.
        schema = drain_schemas.enter_context(pg_schema(args.pg_url))
        store = PostgresStore(args.pg_url, schema=schema, notify=False)
        store.migrate()
        return store

    with ExitStack() as drain_schemas:
        drains("PG", args, fresh)


def explain(store: PostgresStore, url: str) -> None:
    """``EXPLAIN (ANALYZE, BUFFERS)`` of a claim of 100, in a transaction rolled back."""
    name, params = store.statements.claim_query(100, LEASE, None, "release")
    query = b"EXPLAIN (ANALYZE, BUFFERS) " + store.dialect.queries[name]
    with psycopg.connect(url) as conn:
        plan = [row[0] for row in conn.execute(query, store.dialect.params(params))]
        conn.rollback()
    print("\n".join(plan), flush=True)


def run_sqlite(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="outboxkit-bench-") as tmp:
        stores: dict[str, Any] = {}
        with ExitStack() as stack:
            for name, layout in layouts(args).items():
                store = stack.enter_context(SQLiteStore(Path(tmp, f"{name}.db")))
                fill(store, args.due, args.keys, layout)
                stores[name] = store
            report("SQLite", args, stores)
        counter = iter(range(1 << 30))
        drains("SQLite", args, lambda: SQLiteStore(Path(tmp, f"drain-{next(counter)}.db")))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--backend", choices=("pg", "sqlite", "both"), default="both")
    parser.add_argument("--due", type=int, default=100_000, help="due events per claim table")
    parser.add_argument("--keys", type=int, default=10_000, help="keys in the keyed tables")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--claims", type=int, default=50, help="timed claims per side and round")
    parser.add_argument("--drain", type=int, default=5_000, help="events per drain")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="10,000 due, 1,000 keys, 2 rounds")
    parser.add_argument("--explain", action="store_true", help="print the keyed claims' plans")
    parser.add_argument("--pg-url", default=pg_url_default())
    args = parser.parse_args()
    if args.quick:
        args.due, args.keys, args.claims, args.drain, args.rounds = 10_000, 1_000, 20, 1_000, 2
    if args.backend in ("pg", "both"):
        run_pg(args)
    if args.backend in ("sqlite", "both"):
        run_sqlite(args)


if __name__ == "__main__":
    main()
