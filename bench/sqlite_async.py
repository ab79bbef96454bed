"""The SQLite store's asyncio side against its blocking side: the same drain, both pollers.

N pre-enqueued events on a fresh database file per run, one transactional handler doing one
ledger insert through ``ctx.connection`` (a plain function on the blocking poller, an
``async def`` awaiting aiosqlite on the asyncio one). Each run drains with ``run_until_idle()``;
the blocking poller, the asyncio poller with ``concurrency=1`` and with ``concurrency=4`` take
turns, round after round (the order rotating), so that a noisy machine slows all of them alike.

    python bench/sqlite_async.py                          # 5,000 events, 5 rounds
    python bench/sqlite_async.py --events 20000 --rounds 3
    python bench/sqlite_async.py --io-ms 1                # plus a 1 ms non-transactional wait

``--io-ms`` adds a second handler, not transactional, that waits that long (``time.sleep`` on
the blocking poller, ``asyncio.sleep`` on the asyncio one): the kind of handler concurrency is
for. Prints each configuration's median events/s and its ratio to the blocking poller's (the
median of the per-round ratios, and all of them).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import tempfile
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from _common import median

TOPIC = "bench.async"
BLOCKING = "blocking"
CONFIGURATIONS = (BLOCKING, "asyncio c=1", "asyncio c=4")


def _bus(io_ms: float, asyncio_side: bool) -> Any:
    from outboxkit import EventBus

    bus = EventBus()
    insert = "INSERT INTO ledger (event_id) VALUES (?)"
    if asyncio_side:

        @bus.handler(TOPIC, name="ledger")
        async def ledger_async(event: Any, ctx: Any) -> None:
            await ctx.connection.execute(insert, (event.id,))

        if io_ms:

            @bus.handler(TOPIC, name="io", transactional=False)
            async def io_async(event: Any, ctx: Any) -> None:
                await asyncio.sleep(io_ms / 1000)

    else:

        @bus.handler(TOPIC, name="ledger")
        def ledger(event: Any, ctx: Any) -> None:
            ctx.connection.execute(insert, (event.id,))

        if io_ms:

            @bus.handler(TOPIC, name="io", transactional=False)
            def io(event: Any, ctx: Any) -> None:
                time.sleep(io_ms / 1000)

    return bus


def _fill(path: Path, events: int) -> None:
    from outboxkit import EventBus, Outbox
    from outboxkit_sqlite import SQLiteStore

    with SQLiteStore(path) as store:
        outbox = Outbox(store, EventBus(), load_entry_points=False)
        with store.transaction() as conn:
            conn.execute("CREATE TABLE ledger (event_id INTEGER NOT NULL)")
            for start in range(0, events, 1000):
                count = min(1000, events - start)
                outbox.enqueue_many(conn, [(TOPIC, {"n": start + n}) for n in range(count)])


def _drain(path: Path, configuration: str, args: argparse.Namespace) -> float:
    """Seconds to drain the file with ``configuration``'s poller."""
    from outboxkit import Outbox
    from outboxkit_sqlite import SQLiteStore

    blocking = configuration == BLOCKING
    with SQLiteStore(path) as store:
        outbox = Outbox(store, _bus(args.io_ms, not blocking), load_entry_points=False)
        if blocking:
            poller = outbox.poller(batch_size=args.batch_size)
            started = time.perf_counter()
            poller.run_until_idle()
            return time.perf_counter() - started
        concurrency = int(configuration.rpartition("=")[2])
        apoller = outbox.async_poller(batch_size=args.batch_size, concurrency=concurrency)

        async def drain() -> float:
            started = time.perf_counter()
            await apoller.run_until_idle()
            return time.perf_counter() - started

        return asyncio.run(drain())


def _run(configuration: str, args: argparse.Namespace) -> float:
    """Events/s of one drain on a fresh file."""
    with tempfile.TemporaryDirectory(prefix="outboxkit-bench-") as tmp:
        path = Path(tmp) / "bench.db"
        _fill(path, args.events)
        seconds = _drain(path, configuration, args)
        with closing(sqlite3.connect(path)) as conn:
            (rows,) = conn.execute("SELECT count(DISTINCT event_id) FROM ledger").fetchone()
        if rows != args.events:
            print(f"  warning: {configuration}: the ledger holds {rows} of {args.events} events")
    return float(args.events / seconds)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--io-ms", type=float, default=0.0, help="a non-transactional wait")
    args = parser.parse_args(argv)
    rates: dict[str, list[float]] = {c: [] for c in CONFIGURATIONS}
    print(
        f"SQLite, {args.events:,} events, batch {args.batch_size}, {args.rounds} rounds"
        + (f", plus a {args.io_ms:g} ms non-transactional wait per event" if args.io_ms else "")
        + f" (pid {os.getpid()})"
    )
    for round_ in range(args.rounds):
        shift = round_ % len(CONFIGURATIONS)
        for configuration in CONFIGURATIONS[shift:] + CONFIGURATIONS[:shift]:
            rates[configuration].append(_run(configuration, args))
        print(
            f"  round {round_ + 1}: "
            + ", ".join(f"{c} {rates[c][-1]:,.0f} ev/s" for c in CONFIGURATIONS)
        )
    for configuration in CONFIGURATIONS:
        line = f"{configuration:>12}: {median(rates[configuration]):>8,.0f} ev/s"
        if configuration != BLOCKING:
            ratios = [
                rate / base
                for rate, base in zip(rates[configuration], rates[BLOCKING], strict=True)
            ]
            line += f"   {median(ratios):.2f}x blocking ({', '.join(f'{r:.2f}' for r in ratios)})"
        print(line)


if __name__ == "__main__":
    main()
