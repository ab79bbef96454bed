"""asyncio poller throughput: ``AsyncPoller`` at concurrency 1, 4 and 16 beside the blocking
``Poller``, draining the same pre-enqueued events to a no-op handler.

On PostgreSQL when its store has an asyncio side (``capabilities.asyncio``); otherwise on the
memory store, and the first line says so. Each measurement gets a fresh store (a fresh schema on
PostgreSQL) with ``--events`` events enqueued, then one poller drains them with
``run_until_idle`` (timed, the event loop's own start and end excluded). Configurations
alternate within each round (blocking, c=1, c=4, c=16, then again), so that a slow spell of a
shared machine falls on all of them alike.

    python bench/async_throughput.py                         # PG if it can, else memory
    python bench/async_throughput.py --backend memory --events 5000 --rounds 5

Prints events/s per configuration (median over the rounds, and each round's), and the ratio of
each to the blocking poller: of the medians, and round by round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from _common import median, pg_schema, pg_url_default

from outboxkit import EventBus, MemoryStore, Outbox, Store
from outboxkit.poller import ThreadWaiter
from outboxkit.waiter import LoopWaiter

TOPIC = "bench.async"
CONCURRENCIES = (1, 4, 16)
ENQUEUE_PAGE = 1000


@dataclass(frozen=True)
class Config:
    name: str
    concurrency: int | None  # None: the blocking poller


CONFIGS = [Config("blocking", None)] + [Config(f"asyncio c={c}", c) for c in CONCURRENCIES]


def blocking_bus() -> EventBus:
    bus = EventBus()
    bus.subscribe(TOPIC, lambda event, ctx: None, name="noop")
    return bus


def async_bus() -> EventBus:
    bus = EventBus()

    async def noop(event: Any, ctx: Any) -> None:
        pass

    # Transactional, like the blocking one: each delivery commits its record in a transaction.
    bus.subscribe(TOPIC, noop, name="noop")
    return bus


StoreFactory = Callable[[], contextlib.AbstractContextManager[Store]]


@contextlib.contextmanager
def memory_store() -> Iterator[Store]:
    yield MemoryStore()


def pg_store_factory(url: str) -> StoreFactory:
    @contextlib.contextmanager
    def open_pg() -> Iterator[Store]:
        from outboxkit_pg import PostgresStore

        with pg_schema(url, "outboxkit_bench_async") as schema:
            store = PostgresStore(url, schema=schema, notify=False)
            try:
                store.migrate()
                yield store
            finally:
                store.close()

    return open_pg


def choose_backend(backend: str, url: str) -> tuple[str, StoreFactory]:
    """The store the run measures, and a line saying which and why."""
    if backend == "memory":
        return "memory store (--backend memory)", memory_store
    try:
        factory = pg_store_factory(url)
        with factory() as store:
            has_asyncio = store.capabilities.asyncio
    except Exception as exc:  # no server, no driver: say so, and measure what can be measured
        if backend == "pg":
            raise
        return f"memory store (PostgreSQL unavailable: {type(exc).__name__})", memory_store
    if has_asyncio:
        return "PostgreSQL", factory
    if backend == "pg":
        raise SystemExit("the PostgreSQL store has no asyncio side (capabilities.asyncio is false)")
    return (
        "memory store: the PostgreSQL store has no asyncio side (capabilities.asyncio is false)",
        memory_store,
    )


def fill(outbox: Outbox, events: int) -> None:
    store = outbox.store
    for start in range(0, events, ENQUEUE_PAGE):
        with store.transaction() as conn:
            outbox.enqueue_many(
                conn, [(TOPIC, {"n": n}) for n in range(start, min(events, start + ENQUEUE_PAGE))]
            )


def measure(config: Config, factory: StoreFactory, events: int, batch_size: int) -> float:
    """Events per second of one drain of ``events`` events on a fresh store."""
    with factory() as store:
        bus = blocking_bus() if config.concurrency is None else async_bus()
        outbox = Outbox(store, bus, load_entry_points=False, retain_published=None)
        fill(outbox, events)
        if config.concurrency is None:
            poller = outbox.poller(batch_size=batch_size, waiter=ThreadWaiter())
            started = time.perf_counter()
            reports = poller.run_until_idle()
            elapsed = time.perf_counter() - started
        else:
            async_poller = outbox.async_poller(
                concurrency=config.concurrency, batch_size=batch_size, waiter=LoopWaiter()
            )

            async def drain() -> tuple[float, Any]:
                try:
                    started = time.perf_counter()
                    done = await async_poller.run_until_idle()
                    return time.perf_counter() - started, done
                finally:
                    await async_poller.store.close()

            elapsed, reports = asyncio.run(drain())
        published = sum(len(r.published) for r in reports)
        if published != events:
            raise RuntimeError(f"{config.name}: published {published} of {events} events")
    return events / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=3000, help="events per drain (3,000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every config (3)")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--backend", choices=["auto", "pg", "memory"], default="auto")
    parser.add_argument("--pg-url", default=pg_url_default())
    args = parser.parse_args()

    where, factory = choose_backend(args.backend, args.pg_url)
    print(
        f"async_throughput: {args.events:,} events per drain, batch {args.batch_size}, "
        f"{args.rounds} alternating rounds, no-op transactional handler; on the {where}"
    )
    rates: dict[str, list[float]] = {c.name: [] for c in CONFIGS}
    for _ in range(args.rounds):
        for config in CONFIGS:
            rates[config.name].append(measure(config, factory, args.events, args.batch_size))

    floor = rates["blocking"]
    print(f"{'configuration':<14} {'median ev/s':>12}  {'ratio':>6}  rounds: ev/s (ratio)")
    for config in CONFIGS:
        mine = rates[config.name]
        per_round = ", ".join(f"{r:,.0f} ({r / b:.2f}x)" for r, b in zip(mine, floor, strict=True))
        print(
            f"{config.name:<14} {median(mine):>12,.0f}  {median(mine) / median(floor):>5.2f}x  "
            f"{per_round}"
        )


if __name__ == "__main__":
    main()
