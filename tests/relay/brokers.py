"""The real brokers the relay tests publish to, each with names of its own per test.

RabbitMQ (``OUTBOXKIT_TEST_RABBITMQ``, default ``amqp://guest:guest@127.0.0.1:5672/``), NATS
with JetStream (``OUTBOXKIT_TEST_NATS``, default ``nats://127.0.0.1:4222``) and Redis
(``OUTBOXKIT_TEST_REDIS``, default ``redis://127.0.0.1:6379/0``). A test whose broker does not
answer is skipped, naming it; with ``OUTBOXKIT_REQUIRE_BROKERS=1`` (as in CI) it fails.

Every test gets a unique topic prefix (``okt<hex>``): RabbitMQ a topic exchange and a queue
bound to ``<prefix>.#``, NATS a stream on subjects ``<prefix>.>``, Redis the streams named
``<prefix>.*``; all deleted afterwards.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import pytest

from outboxkit.relay import BrokerRelay

RABBITMQ_URL = os.environ.get("OUTBOXKIT_TEST_RABBITMQ", "amqp://guest:guest@127.0.0.1:5672/")
NATS_URL = os.environ.get("OUTBOXKIT_TEST_NATS", "nats://127.0.0.1:4222")
REDIS_URL = os.environ.get("OUTBOXKIT_TEST_REDIS", "redis://127.0.0.1:6379/0")

BROKERS = ["rabbitmq", "nats", "redis"]


def require(name: str, url: str) -> None:
    """Skip (or under OUTBOXKIT_REQUIRE_BROKERS=1 fail) when nothing listens at ``url``."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=2):
            return
    except OSError as exc:
        problem = f"no {name} at {parts.hostname}:{parts.port} ({exc})"
    if os.environ.get("OUTBOXKIT_REQUIRE_BROKERS") == "1":
        pytest.fail(f"OUTBOXKIT_REQUIRE_BROKERS=1 but {problem}", pytrace=False)
    pytest.skip(f"{problem}; start it or set OUTBOXKIT_TEST_{name.upper()}")


class Got(NamedTuple):
    """One consumed message: what a consumer reads back."""

    event_id: int  # the outbox's local id (outbox-event-id)
    topic: str  # outbox-topic
    body: bytes
    headers: dict[str, Any]  # outbox-* headers (fields) and the event's own
    message_id: str  # the relay module's event_id(message): the dedupe key
    broker_id: str  # the broker's own message id: AMQP message_id, Nats-Msg-Id, the entry's field


@dataclass
class Broker:
    """One broker's names for one test, and what a consumer reads back."""

    name: str
    url: str
    prefix: str
    make: Callable[..., BrokerRelay[Any]]
    # every consumed message (``Got``), in the broker's order
    read: Callable[[], Any]
    # how many messages the broker holds for the test, without consuming them
    count: Callable[[], Any]
    extra: dict[str, Any] = field(default_factory=dict)

    def topic(self, rest: str) -> str:
        return f"{self.prefix}.{rest}"

    def relay(self, **options: Any) -> BrokerRelay[Any]:
        return self.make(self.url, **options)

    async def ids(self) -> list[int]:
        """The local event ids of every message the broker holds."""
        return [m.event_id for m in await self.read()]

    async def message_ids(self) -> list[str]:
        """The message identities (``event_id(message)``) of every message the broker holds."""
        return [m.message_id for m in await self.read()]


def new_prefix() -> str:
    return f"okt{uuid.uuid4().hex[:12]}"


@asynccontextmanager
async def rabbitmq(url: str = RABBITMQ_URL) -> AsyncIterator[Broker]:
    """Each step on a connection of its own: a fault test may close every connection."""
    import aio_pika

    from outboxkit.relay import rabbitmq as rmq

    require("rabbitmq", url)
    prefix = new_prefix()
    async with await aio_pika.connect(url) as connection:
        channel = await connection.channel()
        exchange = await channel.declare_exchange(prefix, aio_pika.ExchangeType.TOPIC)
        queue = await channel.declare_queue(prefix)
        await queue.bind(exchange, f"{prefix}.#")

    async def read() -> list[Got]:
        got = []
        async with await aio_pika.connect(url) as connection:
            channel = await connection.channel()
            await channel.set_qos(prefetch_count=1000)
            queue = await channel.get_queue(prefix)
            while (message := await queue.get(no_ack=True, fail=False)) is not None:
                headers = dict(message.headers)
                got.append(
                    Got(
                        int(str(headers["outbox-event-id"])),
                        str(message.type),
                        message.body,
                        headers,
                        rmq.event_id(message),
                        str(message.message_id),
                    )
                )
        return got

    async def count() -> int:
        async with await aio_pika.connect(url) as connection:
            channel = await connection.channel()
            declared = await channel.declare_queue(prefix, passive=True)
            return int(declared.declaration_result.message_count or 0)

    def make(url: str, **options: Any) -> BrokerRelay[Any]:
        options.setdefault("exchange", prefix)
        return rmq.RabbitMQRelay(url, **options)

    try:
        yield Broker("rabbitmq", url, prefix, make, read, count)
    finally:
        async with await aio_pika.connect(url) as connection:
            channel = await connection.channel()
            await channel.queue_delete(prefix)
            await channel.exchange_delete(prefix)


@asynccontextmanager
async def nats_jetstream(
    url: str = NATS_URL, duplicate_window: float = 120.0
) -> AsyncIterator[Broker]:
    import nats
    from nats.js.api import StreamConfig

    from outboxkit.relay import nats as relay_nats

    require("nats", url)
    prefix = new_prefix()
    client = await nats.connect(url)
    js = client.jetstream()
    stream = prefix.upper()
    await js.add_stream(
        StreamConfig(name=stream, subjects=[f"{prefix}.>"], duplicate_window=duplicate_window)
    )

    async def read() -> list[Got]:
        info = await js.stream_info(stream)
        got = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await js.get_msg(stream, seq)
            headers = dict(msg.headers or {})
            got.append(
                Got(
                    int(headers["outbox-event-id"]),
                    headers["outbox-topic"],
                    msg.data,
                    headers,
                    relay_nats.event_id(msg),
                    headers["Nats-Msg-Id"],
                )
            )
        return got

    async def count() -> int:
        return int((await js.stream_info(stream)).state.messages)

    try:
        yield Broker(
            "nats", url, prefix, relay_nats.NatsRelay, read, count, {"js": js, "stream": stream}
        )
    finally:
        await js.delete_stream(stream)
        await client.close()


@asynccontextmanager
async def redis_streams(url: str = REDIS_URL) -> AsyncIterator[Broker]:
    import json

    import redis.asyncio as aioredis

    from outboxkit.relay import redis as relay_redis

    require("redis", url)
    prefix = new_prefix()
    # The test's own reads each on a fresh client: a restart test restarts the server under it.
    client = aioredis.Redis.from_url(url)

    def fresh() -> Any:
        return aioredis.Redis.from_url(url)

    async def streams(c: Any) -> list[bytes]:
        return sorted([k async for k in c.scan_iter(match=f"{prefix}.*", _type="stream")])

    async def read() -> list[Got]:
        async with fresh() as c:
            entries = [e for stream in await streams(c) for e in await c.xrange(stream)]
        got = []
        for _entry_id, fields in entries:
            headers = json.loads(fields[b"headers"])
            headers.update(
                {k.decode(): v.decode() for k, v in fields.items() if k.startswith(b"outbox-")}
            )
            got.append(
                Got(
                    int(headers["outbox-event-id"]),
                    headers["outbox-topic"],
                    fields[b"payload"],
                    headers,
                    relay_redis.event_id(fields),
                    headers["outbox-message-id"],
                )
            )
        return got

    async def count() -> int:
        async with fresh() as c:
            return sum([int(await c.xlen(stream)) for stream in await streams(c)])

    def make(url: str, **options: Any) -> BrokerRelay[Any]:
        options.setdefault("client_name", f"okt-{prefix}")  # CLIENT KILL finds it by name
        return relay_redis.RedisRelay(url, **options)

    try:
        yield Broker("redis", url, prefix, make, read, count, {"client": client})
    finally:
        async with fresh() as c:
            for stream in await streams(c):
                await c.delete(stream)
        await client.aclose()


OPENERS = {"rabbitmq": rabbitmq, "nats": nats_jetstream, "redis": redis_streams}
