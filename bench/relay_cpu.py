"""Where a relay's time goes: outboxkit's own CPU per event, without a broker.

``relay.py`` measures the relays against the minimal loop with real brokers; there the broker
clients' work and the database's share the figure. This script takes the broker out: a relay
that confirms every event at once (it still builds each message, as a real relay does) against
the minimal loop with a publisher that builds the same message and sends nothing. For each, on
PostgreSQL, ``--events`` events drained in batches of ``--batch`` (``transaction="per_batch"``):

- **CPU**: this process's CPU time per event (``time.process_time``): outboxkit's Python (and
  the driver's), which a faster machine does not hide;
- **wall**: elapsed time per event; wall minus CPU is mostly the database's share.

Rounds alternate: minimal loop, asyncio poller, blocking poller; medians printed.

    python bench/relay_cpu.py                  # 20,000 events, 3 rounds
    python bench/relay_cpu.py --events 5000 --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from typing import Any

import psycopg
from _common import median, pg_schema, pg_url_default
from psycopg import sql
from relay import message_headers, minimal_table, payload

from outboxkit import Event, EventBus, Message, Outbox, open_store
from outboxkit.relay import message_of, topic_destination

TOPIC = "bench.order.placed"


class ConfirmingRelay:
    """A relay whose broker confirms everything at once: each event's message is built (the
    relays' shared ``message_of``) and nothing is sent."""

    async def publish(self, events: Sequence[Event]) -> list[Exception | None]:
        return self.publish_blocking(events)

    def publish_blocking(self, events: Sequence[Event]) -> list[Exception | None]:
        for event in events:
            message_of(event, topic_destination)
        return [None] * len(events)


async def run_outboxkit(
    pg_url: str, events: int, batch: int, *, asyncio_poller: bool
) -> tuple[float, float]:
    with pg_schema(pg_url, "bench_relay_cpu") as schema:
        store = open_store(pg_url, schema=schema)
        store.migrate()
        bus = EventBus()
        bus.relay(ConfirmingRelay(), topics=["bench.#"], name="relay")
        outbox = Outbox(store, bus, load_entry_points=False)
        for start in range(0, events, 5000):
            with store.transaction() as tx:
                outbox.enqueue_many(
                    tx,
                    [Message(TOPIC, payload(i)) for i in range(start, min(events, start + 5000))],
                )
        cpu, wall = time.process_time(), time.perf_counter()
        if asyncio_poller:
            await outbox.async_poller(batch_size=batch, transaction="per_batch").run_until_idle()
        else:
            poller = outbox.poller(batch_size=batch, transaction="per_batch")
            poller.run_until_idle()  # blocking, on purpose: the CPU is this thread's
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        if asyncio_poller:
            await store.async_store().close()
        store.close()
    return cpu / events * 1e6, wall / events * 1e6


async def run_minimal(pg_url: str, events: int, batch: int) -> tuple[float, float]:
    with pg_schema(pg_url, "bench_relay_cpu_min") as schema:
        select, mark = minimal_table(pg_url, sql.Identifier(schema, "m_events"), TOPIC, events)
        sent: list[Any] = []
        async with await psycopg.AsyncConnection.connect(pg_url) as aconn:
            cpu, wall = time.process_time(), time.perf_counter()
            while True:
                async with aconn.transaction():
                    rows = await (await aconn.execute(select, (batch,))).fetchall()
                    if not rows:
                        break
                    sent[:] = [(r[1], r[2].encode(), message_headers(r)) for r in rows]
                    await aconn.execute(mark, ([r[0] for r in rows],))
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return cpu / events * 1e6, wall / events * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--pg-url", default=pg_url_default())
    args = parser.parse_args()
    figures: dict[str, list[tuple[float, float]]] = {
        "minimal loop": [],
        "asyncio poller": [],
        "blocking poller": [],
    }
    for round_no in range(args.rounds):
        figures["minimal loop"].append(
            asyncio.run(run_minimal(args.pg_url, args.events, args.batch))
        )
        figures["asyncio poller"].append(
            asyncio.run(run_outboxkit(args.pg_url, args.events, args.batch, asyncio_poller=True))
        )
        figures["blocking poller"].append(
            asyncio.run(run_outboxkit(args.pg_url, args.events, args.batch, asyncio_poller=False))
        )
        print(f"  round {round_no + 1} done")
    print(f"\n{args.events:,} events, batch {args.batch}, medians of {args.rounds} round(s):")
    base_cpu = median([c for c, _ in figures["minimal loop"]])
    for name, values in figures.items():
        cpu, wall = median([c for c, _ in values]), median([w for _, w in values])
        print(
            f"  {name:16} CPU {cpu:6.1f} us/event ({cpu / base_cpu:4.1f}x the minimal loop's)  "
            f"wall {wall:6.1f} us/event  wall - CPU {wall - cpu:6.1f}"
        )


if __name__ == "__main__":
    main()
