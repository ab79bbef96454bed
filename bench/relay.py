"""The relays against the minimal loop a user could write, and against a one-at-a-time handler.

For each broker (RabbitMQ, NATS JetStream, Redis Streams), in one process, on PostgreSQL:

- **outboxkit**: ``--events`` events enqueued, then relayed by one poller
  (``transaction="per_batch"``, ``--batch`` events a claim, ``prefetch=True``: the next batch
  claimed while one is relayed) through ``bus.relay(...)``: the blocking poller (the relay on
  its own event loop thread), and, reported apart, the asyncio poller (``outboxkit async``)
  and the blocking poller without ``prefetch``;
- **minimal loop**: the same number of rows in a plain table (id, topic, payload, headers,
  key, created_at, published_at) of the same database; in one transaction per batch: ``SELECT
  ... FOR UPDATE SKIP LOCKED LIMIT --batch``, publish every row with the same client library and
  wait for the broker's confirms together (aio-pika on a confirm channel, nats-py
  ``publish_async`` with ``Nats-Msg-Id``, one redis pipeline of ``XADD``), then one ``UPDATE ...
  published_at`` of the batch. Its messages carry what a relay's carry, the contract a consumer
  reads (the event's id, topic, key, created_at and headers: AMQP headers and ``type``, NATS
  headers, stream entry fields); the same loop with a bare message (id and payload only) is
  reported apart, to show what those fields cost;
- **one at a time**: the handler a user writes today (``transactional=False``, ``async def``):
  publish the event and await its confirm, one by one, under the default per-event poller;
  over ``--events / 10`` events (it is slow), compared by rate.

- **rules floor** (not a reference, reported apart): the bare database doing the writes
  outboxkit's rules ask for (a committed lease at claim, a delivery record per event, a
  settlement fenced by token), with the minimal loop's publisher: how much of the minimal
  loop's lead is the rules' own work.

Only the drain is timed (enqueue and setup excluded). Each round runs them all, the order
rotating from round to round; the figures are the median events/s of each, and the ratios
outboxkit / minimal loop and outboxkit / one at a time.

    python bench/relay.py                      # 20,000 events per broker, 3 rounds
    python bench/relay.py --quick              # 2,000 events, 1 round
    python bench/relay.py --only redis --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import psycopg
from _common import median, pg_schema, pg_url_default
from psycopg import sql

from outboxkit import EventBus, Message, Outbox, open_store

BROKERS = ("rabbitmq", "nats", "redis")
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672/"
NATS_URL = "nats://127.0.0.1:4222"
REDIS_URL = "redis://127.0.0.1:6379/0"


# -- each broker: its names for one run, a relay, a minimal publisher, a one-at-a-time handler ----


Row = tuple[int, str, str, str, "str | None", datetime]
"""A row as the minimal loop reads it: id, topic, payload and headers (JSON text), key,
created_at."""


def message_headers(row: Row) -> dict[str, str]:
    """The headers the minimal loop sends: the message a relay sends carries the event's id,
    topic, key and created_at (and its own headers) for the consumer, so the reference a user
    writes to the same contract carries them too (``--bare`` loops leave them out)."""
    own = row[3]
    headers: dict[str, str] = {} if own == "{}" else json.loads(own)
    headers["outbox-event-id"] = str(row[0])
    headers["outbox-topic"] = row[1]
    if row[4] is not None:
        headers["outbox-key"] = row[4]
    headers["outbox-created-at"] = row[5].isoformat()
    return headers


class Broker:
    """One broker's side of the benchmark (each subclass overrides every method)."""

    name: str
    prefix: str

    async def open(self, prefix: str) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    def relay(self) -> Any:
        raise NotImplementedError

    async def publish_batch(self, rows: list[Row], *, bare: bool = False) -> None:
        raise NotImplementedError

    async def publish_one(self, event_id: int, topic: str, body: bytes) -> None:
        raise NotImplementedError

    async def count(self) -> int:
        raise NotImplementedError


class RabbitMQ(Broker):
    name = "rabbitmq"

    async def open(self, prefix: str) -> None:
        import aio_pika

        self.prefix = prefix
        self.conn = await aio_pika.connect(RABBITMQ_URL)
        self.admin = await self.conn.channel()
        self.exchange_admin = await self.admin.declare_exchange(prefix, aio_pika.ExchangeType.TOPIC)
        self.queue = await self.admin.declare_queue(prefix)
        await self.queue.bind(self.exchange_admin, "#")
        self.channel = await self.conn.channel(publisher_confirms=True, on_return_raises=True)
        self.exchange = await self.channel.get_exchange(prefix)

    async def close(self) -> None:
        await self.queue.delete(if_unused=False, if_empty=False)
        await self.exchange_admin.delete()
        await self.conn.close()

    def relay(self) -> Any:
        from outboxkit.relay.rabbitmq import RabbitMQRelay

        return RabbitMQRelay(RABBITMQ_URL, exchange=self.prefix)

    def _message(self, event_id: int, body: bytes, headers: dict[str, str] | None = None) -> Any:
        import aio_pika

        return aio_pika.Message(
            body,
            headers=dict(headers) if headers is not None else None,
            message_id=str(event_id),
            type=None if headers is None else headers["outbox-topic"],
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )

    async def publish_batch(self, rows: list[Row], *, bare: bool = False) -> None:
        await asyncio.gather(
            *(
                self.exchange.publish(
                    self._message(r[0], r[2].encode(), None if bare else message_headers(r)),
                    r[1],
                    mandatory=True,
                )
                for r in rows
            )
        )

    async def publish_one(self, event_id: int, topic: str, body: bytes) -> None:
        await self.exchange.publish(self._message(event_id, body), topic, mandatory=True)

    async def count(self) -> int:
        declared = await self.admin.declare_queue(self.prefix, passive=True)
        return int(declared.declaration_result.message_count or 0)


class Nats(Broker):
    name = "nats"

    async def open(self, prefix: str) -> None:
        import nats
        from nats.js.api import StreamConfig

        self.prefix = prefix
        self.client = await nats.connect(NATS_URL)
        self.js = self.client.jetstream()
        self.stream = prefix.upper()
        await self.js.add_stream(StreamConfig(name=self.stream, subjects=[f"{prefix}.>"]))

    async def close(self) -> None:
        await self.js.delete_stream(self.stream)
        await self.client.close()

    def relay(self) -> Any:
        from outboxkit.relay.nats import NatsRelay

        return NatsRelay(NATS_URL)

    async def publish_batch(self, rows: list[Row], *, bare: bool = False) -> None:
        futures = []
        for r in rows:
            headers = {} if bare else message_headers(r)
            headers["Nats-Msg-Id"] = str(r[0])
            futures.append(await self.js.publish_async(r[1], r[2].encode(), headers=headers))
        await asyncio.gather(*futures)

    async def publish_one(self, event_id: int, topic: str, body: bytes) -> None:
        await self.js.publish(topic, body, headers={"Nats-Msg-Id": str(event_id)})

    async def count(self) -> int:
        info = await self.js.stream_info(self.stream)
        return int(info.state.messages)


class Redis(Broker):
    name = "redis"

    async def open(self, prefix: str) -> None:
        import redis.asyncio as aioredis

        self.prefix = prefix
        self.client = aioredis.Redis.from_url(REDIS_URL)

    async def close(self) -> None:
        async for key in self.client.scan_iter(match=f"{self.prefix}.*"):
            await self.client.delete(key)
        await self.client.aclose()

    def relay(self) -> Any:
        from outboxkit.relay.redis import RedisRelay

        return RedisRelay(REDIS_URL)

    async def publish_batch(self, rows: list[Row], *, bare: bool = False) -> None:
        pipe = self.client.pipeline(transaction=False)
        for i, t, p, h, key, created_at in rows:
            entry = {"outbox-event-id": str(i), "headers": h, "payload": p}
            if not bare:
                entry["outbox-topic"] = t
                if key is not None:
                    entry["outbox-key"] = key
                entry["outbox-created-at"] = created_at.isoformat()
            pipe.xadd(t, entry)  # type: ignore[arg-type]
        await pipe.execute()

    async def publish_one(self, event_id: int, topic: str, body: bytes) -> None:
        await self.client.xadd(topic, {"outbox-event-id": str(event_id), "payload": body})

    async def count(self) -> int:
        total = 0
        async for key in self.client.scan_iter(match=f"{self.prefix}.*"):
            total += int(await self.client.xlen(key))
        return total


MAKERS: dict[str, Callable[[], Broker]] = {"rabbitmq": RabbitMQ, "nats": Nats, "redis": Redis}


# -- the contenders -------------------------------------------------------------------------------


def payload(i: int) -> dict[str, Any]:
    return {"order_id": i, "customer": f"c{i % 97}", "total": i * 3 + 0.5}


async def run_outboxkit(
    pg_url: str,
    broker: Broker,
    events: int,
    batch: int,
    *,
    asyncio_poller: bool = False,
    prefetch: bool = True,
) -> float:
    with pg_schema(pg_url, "bench_relay") as schema:
        store = open_store(pg_url, schema=schema)
        store.migrate()
        bus = EventBus()
        relay = broker.relay()
        bus.relay(relay, topics=[f"{broker.prefix}.#"], name="relay")
        outbox = Outbox(store, bus, load_entry_points=False)
        topic = f"{broker.prefix}.order.placed"
        for start in range(0, events, 5000):
            with store.transaction() as tx:
                outbox.enqueue_many(
                    tx,
                    [Message(topic, payload(i)) for i in range(start, min(events, start + 5000))],
                )
        # The relay connects in its first batch, inside the timed part (the minimal loop's
        # connections are made before): if anything, this favours the reference.
        started = time.perf_counter()
        if asyncio_poller:
            await outbox.async_poller(
                batch_size=batch, transaction="per_batch", prefetch=prefetch
            ).run_until_idle()
        else:
            poller = outbox.poller(batch_size=batch, transaction="per_batch", prefetch=prefetch)
            await asyncio.to_thread(poller.run_until_idle)
        elapsed = time.perf_counter() - started
        if asyncio_poller:
            await relay.aclose()
            await store.async_store().close()
        relay.close()
        store.close()
    return events / elapsed


async def run_outboxkit_asyncio(pg_url: str, broker: Broker, events: int, batch: int) -> float:
    return await run_outboxkit(pg_url, broker, events, batch, asyncio_poller=True)


async def run_outboxkit_no_prefetch(pg_url: str, broker: Broker, events: int, batch: int) -> float:
    return await run_outboxkit(pg_url, broker, events, batch, prefetch=False)


def fill(conn: psycopg.Connection[Any], table: sql.Identifier, topic: str, events: int) -> None:
    """``events`` rows of ``topic`` into a bare loop's table, in one transaction."""
    with conn.cursor() as cur, conn.transaction():
        cur.executemany(
            sql.SQL("INSERT INTO {} (topic, payload) VALUES (%s, %s)").format(table),
            [(topic, json.dumps(payload(i))) for i in range(events)],
        )


def minimal_table(
    pg_url: str, table: sql.Identifier, topic: str, events: int
) -> tuple[sql.Composed, sql.Composed]:
    """The minimal loop's plain table, filled with ``events`` rows of ``topic``; returns its two
    statements: the batch's ``SELECT ... FOR UPDATE SKIP LOCKED`` (rows as ``Row``) and the
    ``UPDATE`` that marks a batch published."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "CREATE TABLE {} (id bigserial PRIMARY KEY, topic text NOT NULL, "
                "payload jsonb NOT NULL, headers jsonb NOT NULL DEFAULT '{{}}', key text, "
                "created_at timestamptz NOT NULL DEFAULT now(), published_at timestamptz)"
            ).format(table)
        )
        fill(conn, table, topic, events)
    select = sql.SQL(
        "SELECT id, topic, payload::text, headers::text, key, created_at FROM {} "
        "WHERE published_at IS NULL ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED"
    ).format(table)
    mark = sql.SQL("UPDATE {} SET published_at = now() WHERE id = ANY(%s)").format(table)
    return select, mark


async def run_minimal(
    pg_url: str, broker: Broker, events: int, batch: int, *, bare: bool = False
) -> float:
    with pg_schema(pg_url, "bench_relay_min") as schema:
        table = sql.Identifier(schema, "m_events")
        select, mark = minimal_table(pg_url, table, f"{broker.prefix}.order.placed", events)
        async with await psycopg.AsyncConnection.connect(pg_url) as aconn:
            started = time.perf_counter()
            while True:
                async with aconn.transaction():
                    rows = await (await aconn.execute(select, (batch,))).fetchall()
                    if not rows:
                        break
                    await broker.publish_batch(rows, bare=bare)
                    await aconn.execute(mark, ([r[0] for r in rows],))
            elapsed = time.perf_counter() - started
    return events / elapsed


async def run_minimal_bare(pg_url: str, broker: Broker, events: int, batch: int) -> float:
    return await run_minimal(pg_url, broker, events, batch, bare=True)


async def run_rules_floor(pg_url: str, broker: Broker, events: int, batch: int) -> float:
    """Not a reference: the bare database doing the writes outboxkit's rules ask for, with the
    same publisher as the minimal loop, to say where the minimal loop's lead comes from. The
    claim is a committed lease (R3: the attempt counted, a token); after the confirms, one
    transaction writes a delivery record per event (R6) and settles the batch fenced by the
    tokens (R8). Its tables are outboxkit's shapes (the due index, the records' primary key)
    without the records' foreign key."""
    with pg_schema(pg_url, "bench_relay_floor") as schema:
        table = sql.Identifier(schema, "f_events")
        records = sql.Identifier(schema, "f_records")
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(
                sql.SQL(
                    "CREATE TABLE {} (id bigserial PRIMARY KEY, topic text NOT NULL, "
                    "payload jsonb NOT NULL, headers jsonb NOT NULL DEFAULT '{{}}', "
                    "available_at timestamptz NOT NULL DEFAULT now(), "
                    "attempts integer NOT NULL DEFAULT 0, locked_until timestamptz, "
                    "claim_token uuid, key text, created_at timestamptz NOT NULL DEFAULT now(), "
                    "published_at timestamptz) WITH (fillfactor = 80)"
                ).format(table)
            )
            conn.execute(
                sql.SQL("CREATE INDEX ON {} (available_at, id) WHERE published_at IS NULL").format(
                    table
                )
            )
            conn.execute(
                sql.SQL(
                    "CREATE TABLE {} (event_id bigint NOT NULL, handler text NOT NULL, "
                    "outcome text NOT NULL, attempt integer NOT NULL, "
                    "recorded_at timestamptz NOT NULL DEFAULT now(), "
                    "PRIMARY KEY (event_id, handler))"
                ).format(records)
            )
            fill(conn, table, f"{broker.prefix}.order.placed", events)
        claim = sql.SQL(
            "UPDATE {t} AS e SET locked_until = now() + interval '30 seconds', "
            "attempts = e.attempts + 1, claim_token = gen_random_uuid() "
            "FROM (SELECT id FROM {t} WHERE published_at IS NULL AND available_at <= now() "
            "AND (locked_until IS NULL OR locked_until <= now()) ORDER BY available_at, id "
            "LIMIT %s FOR UPDATE SKIP LOCKED) AS due WHERE e.id = due.id "
            "RETURNING e.id, e.topic, e.payload::text, e.headers::text, e.key, e.created_at, "
            "e.claim_token, e.attempts"
        ).format(t=table)
        record = sql.SQL(
            "INSERT INTO {r} (event_id, handler, outcome, attempt) "
            "SELECT e.id, 'relay', 'succeeded', r.attempt "
            "FROM unnest(%s::bigint[], %s::uuid[], %s::integer[]) AS r (id, token, attempt) "
            "JOIN {t} AS e ON e.id = r.id AND e.claim_token = r.token"
        ).format(r=records, t=table)
        settle = sql.SQL(
            "UPDATE {t} AS e SET published_at = now(), locked_until = NULL, claim_token = NULL "
            "FROM unnest(%s::bigint[], %s::uuid[]) AS r (id, token) "
            "WHERE e.id = r.id AND e.claim_token = r.token"
        ).format(t=table)
        async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as aconn:
            started = time.perf_counter()
            while True:
                rows = await (await aconn.execute(claim, (batch,))).fetchall()
                if not rows:
                    break
                await broker.publish_batch([r[:6] for r in rows])
                ids, tokens, attempts = (
                    [r[0] for r in rows],
                    [r[6] for r in rows],
                    [r[7] for r in rows],
                )
                async with aconn.transaction():
                    await aconn.execute(record, (ids, tokens, attempts))
                    await aconn.execute(settle, (ids, tokens))
            elapsed = time.perf_counter() - started
    return events / elapsed


async def run_one_at_a_time(pg_url: str, broker: Broker, events: int, batch: int) -> float:
    events = max(1, events // 10)
    with pg_schema(pg_url, "bench_relay_one") as schema:
        store = open_store(pg_url, schema=schema)
        store.migrate()
        bus = EventBus()
        topic = f"{broker.prefix}.order.placed"

        async def publish(event: Any, ctx: Any) -> None:
            body = json.dumps(event.payload).encode()
            await broker.publish_one(event.id, event.topic, body)

        bus.subscribe(topic, publish, name="publish", transactional=False)
        outbox = Outbox(store, bus, load_entry_points=False)
        with store.transaction() as tx:
            outbox.enqueue_many(tx, [Message(topic, payload(i)) for i in range(events)])
        poller = outbox.async_poller(batch_size=batch)
        started = time.perf_counter()
        await poller.run_until_idle()
        elapsed = time.perf_counter() - started
        await store.async_store().close()
        store.close()
    return events / elapsed


CONTENDERS: dict[str, Callable[[str, Broker, int, int], Awaitable[float]]] = {
    "outboxkit": run_outboxkit,
    "outboxkit async": run_outboxkit_asyncio,
    "minimal loop": run_minimal,
    "one at a time": run_one_at_a_time,
    "rules floor": run_rules_floor,
    "minimal, bare": run_minimal_bare,
    "no prefetch": run_outboxkit_no_prefetch,
}


async def bench(broker_name: str, args: argparse.Namespace) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    names = list(CONTENDERS)
    for round_no in range(args.rounds):
        order = names[round_no % len(names) :] + names[: round_no % len(names)]
        for name in order:
            broker = MAKERS[broker_name]()
            await broker.open(f"bench{uuid.uuid4().hex[:10]}")
            try:
                rate = await CONTENDERS[name](args.pg_url, broker, args.events, args.batch)
                expected = args.events if name != "one at a time" else max(1, args.events // 10)
                got = await broker.count()
                if got != expected:
                    raise SystemExit(f"{broker_name} {name}: {got} messages, expected {expected}")
            finally:
                await broker.close()
            rates[name].append(rate)
            print(f"  {broker_name:8} round {round_no + 1}  {name:14} {rate:9,.0f} events/s")
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--only", action="append", choices=BROKERS)
    parser.add_argument("--pg-url", default=pg_url_default())
    parser.add_argument("--quick", action="store_true", help="2,000 events, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.events, args.rounds = 2_000, 1
    print(
        f"relay benchmark: {args.events:,} events per broker (one at a time: "
        f"{max(1, args.events // 10):,}), batch {args.batch}, {args.rounds} round(s), PostgreSQL"
    )
    summary = []
    for broker_name in args.only or BROKERS:
        rates = asyncio.run(bench(broker_name, args))
        med = {name: median(values) for name, values in rates.items()}
        summary.append(
            f"{broker_name:8}  outboxkit {med['outboxkit']:9,.0f}/s  minimal loop "
            f"{med['minimal loop']:9,.0f}/s  one at a time {med['one at a time']:7,.0f}/s  "
            f"ratio vs minimal {med['outboxkit'] / med['minimal loop']:.2f}x  "
            f"vs one at a time {med['outboxkit'] / med['one at a time']:.1f}x\n"
            f"{'':8}  asyncio poller {med['outboxkit async']:9,.0f}/s  "
            f"ratio vs minimal {med['outboxkit async'] / med['minimal loop']:.2f}x\n"
            f"{'':8}  blocking poller without prefetch {med['no prefetch']:9,.0f}/s  "
            f"ratio vs minimal {med['no prefetch'] / med['minimal loop']:.2f}x\n"
            f"{'':8}  rules floor (bare SQL, not a reference) {med['rules floor']:9,.0f}/s  "
            f"= {med['rules floor'] / med['minimal loop']:.2f}x the minimal loop; "
            f"outboxkit {med['outboxkit'] / med['rules floor']:.2f}x the floor\n"
            f"{'':8}  minimal loop, bare message (not the reference) "
            f"{med['minimal, bare']:9,.0f}/s: the event's id, topic, key and created_at "
            f"cost the minimal loop {1 - med['minimal loop'] / med['minimal, bare']:.0%}"
        )
    print("\nmedians:")
    for line in summary:
        print(line)


if __name__ == "__main__":
    main()
