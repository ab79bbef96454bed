"""Relays under faults: the broker's connection killed or the broker restarted mid-relay, and a
poller SIGKILLed mid-batch. Each test relays ``EVENTS`` events from a SQLite file and then
counts what the broker holds: lost = 0; duplicates only for the events in flight at a fault,
at most a batch per fault; every event published once in the outbox, with its one record.

Restarts use private broker processes on free ports (NATS with a JetStream store directory of
its own, Redis with an append-only file synced on every write), so that no other test's broker
goes down. Killing RabbitMQ's connections (``rabbitmqctl close_all_connections``) acts on the
shared server: run this tier alone (CI does).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from outboxkit import EventBus, HandlerFailed, Message, Outbox, hookimpl, open_store
from outboxkit.relay import BrokerRelay
from tests.faults._scale import scale
from tests.relay.brokers import Broker, nats_jetstream, rabbitmq, redis_streams

pytestmark = [pytest.mark.faults, pytest.mark.asyncio]

EVENTS = scale(pr=3000, large=20000)
BATCH = 100
ROOT = Path(__file__).resolve().parents[2]


# -- helpers --------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def until(condition: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    """Wait (bounded) until ``condition`` holds, checking it every 20 ms; a check that raises
    (the broker is restarting under the test's own client) counts as not yet."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            if await condition():
                return
        except Exception as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}") from last
        await asyncio.sleep(0.02)


def port_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class Private:
    """A broker process of this test's own, on a free port, restartable."""

    def __init__(self, argv: list[str], port: int) -> None:
        self.argv, self.port = argv, port
        self.process: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        self.process = subprocess.Popen(
            self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

        async def up() -> bool:
            return port_answers(self.port)

        await until(up, 30, f"{self.argv[0]} on port {self.port}")

    async def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            await asyncio.to_thread(self.process.wait, 20)
        self.process = None

    async def restart(self) -> None:
        await self.stop()
        await self.start()


@asynccontextmanager
async def private_nats(tmp_path: Path) -> AsyncIterator[tuple[Private, Broker]]:
    port = free_port()
    server = Private(
        ["nats-server", "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(tmp_path / "js")],
        port,
    )
    await server.start()
    try:
        async with nats_jetstream(f"nats://127.0.0.1:{port}") as broker:
            yield server, broker
    finally:
        await server.stop()


@asynccontextmanager
async def private_redis(tmp_path: Path) -> AsyncIterator[tuple[Private, Broker]]:
    port = free_port()
    data = tmp_path / "redis"
    data.mkdir()
    server = Private(
        [
            "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "yes", "--appendfsync", "always", "--dir", str(data),
        ],
        port,
    )  # fmt: skip
    await server.start()
    try:
        async with redis_streams(f"redis://127.0.0.1:{port}/0") as broker:
            yield server, broker
    finally:
        await server.stop()


def make_outbox(tmp_path: Path, broker: Broker) -> Outbox:
    bus = EventBus()
    bus.relay(broker.relay(confirm_timeout=5), topics=[broker.topic("#")], name="relay")
    store = open_store(f"sqlite:///{(tmp_path / 'outbox.db').as_posix()}")
    outbox = Outbox(store, bus, load_entry_points=False)
    for start in range(0, EVENTS, 1000):
        with store.transaction() as tx:
            outbox.enqueue_many(
                tx,
                [
                    Message(broker.topic("order.placed"), {"n": i}, key=f"k{i % 13}")
                    for i in range(start, min(EVENTS, start + 1000))
                ],
            )
    return outbox


class RelayFailures:
    """Counts the relay's failed publishes (``HandlerFailed``), as an observer."""

    def __init__(self) -> None:
        self.count = 0

    @hookimpl
    def outboxkit_on_event(self, event: object) -> None:
        if isinstance(event, HandlerFailed):
            self.count += 1


FAULT_TRIES = 20


async def relay_through(outbox: Outbox, broker: Broker, faults: list[Callable[[], Any]]) -> None:
    """Relay with the asyncio poller; each fault strikes once the broker holds another share.

    A fault that lands between two batches fails nothing (the next batch connects afresh): it
    strikes again, once the broker took another batch without a failure, until the relay
    fails some events (``FAULT_TRIES`` times at most; ``check`` then finds it hit nothing)."""
    failures = RelayFailures()
    outbox.add_observer(failures)
    poller = outbox.async_poller(
        batch_size=BATCH, transaction="per_batch", interval=0.05, backoff=0.1, max_retries=10_000
    )
    task = asyncio.create_task(poller.run_forever())
    try:
        for n, fault in enumerate(faults, start=1):
            share = EVENTS * n // (len(faults) + 1)

            async def reached(share: int = share) -> bool:
                return await broker.count() >= share

            await until(reached, 120, f"{share} messages on {broker.name}")
            for _ in range(FAULT_TRIES):
                seen, before = failures.count, await broker.count()
                await fault()

                async def settled(seen: int = seen, before: int = before) -> bool:
                    if failures.count > seen:
                        return True
                    return await broker.count() >= min(EVENTS, before + BATCH)

                await until(settled, 120, f"the relay going on after a fault on {broker.name}")
                if failures.count > seen or await broker.count() >= EVENTS:
                    break

        async def done() -> bool:
            return (await asyncio.to_thread(outbox.stats)).published == EVENTS

        await until(done, 180, f"{EVENTS} events published")
    finally:
        poller.stop()
        await task
        relay = outbox.bus.find("relay").relay
        assert isinstance(relay, BrokerRelay)
        await relay.aclose()
        await outbox.store.async_store().close()


async def check(outbox: Outbox, broker: Broker, label: str, bound: int, capsys: Any) -> None:
    consumed = await broker.ids()
    unique = set(consumed)
    lost = EVENTS - len(unique)
    duplicates = len(consumed) - len(unique)
    stats = outbox.stats()
    ids: list[int] = []
    retried = 0  # events that needed a second attempt: the fault landed on them
    while page := outbox.store.events(after_id=ids[-1] if ids else 0, limit=1000):
        ids += [e.id for e in page]
        retried += sum(e.attempts > 1 for e in page)
    extra_records = sum(len(outbox.store.records(i)) != 1 for i in ids)
    with capsys.disabled():
        print(
            f"\n[faults:relay-{label}] {EVENTS} events, batch {BATCH}: lost={lost} "
            f"duplicates={duplicates} (bound {bound}) published={stats.published} "
            f"dead={stats.dead} records_not_one={extra_records} retried={retried}"
        )
    assert retried > 0, "the fault hit no event: the test proved nothing"
    assert lost == 0
    assert unique <= set(ids)
    assert duplicates <= bound
    assert stats.published == EVENTS and stats.dead == 0
    assert extra_records == 0
    outbox.store.close()


# -- the broker's connection killed / the broker restarted ----------------------------------------


async def test_rabbitmq_connections_closed_mid_relay(tmp_path, capsys):
    async with rabbitmq() as broker:
        outbox = make_outbox(tmp_path, broker)

        async def close_all() -> None:
            await asyncio.to_thread(
                subprocess.run,
                ["rabbitmqctl", "-q", "close_all_connections", "outboxkit relay fault test"],
                check=True,
                capture_output=True,
            )

        await relay_through(outbox, broker, [close_all, close_all])
        await check(outbox, broker, "close-connections-rabbitmq", 2 * BATCH, capsys)


async def test_redis_connection_killed_mid_relay(tmp_path, capsys):
    async with redis_streams() as broker:
        outbox = make_outbox(tmp_path, broker)
        client = broker.extra["client"]
        failed = RelayFailures()
        outbox.add_observer(failed)

        async def kill() -> None:
            # Killed again and again until a batch fails: redis-py opens a new connection at
            # once for a pipeline whose connection was killed between batches, so only a kill
            # that lands while a batch is in flight fails it. Stopped at the first failure (one
            # batch of duplicates at most per fault), and bounded (about two seconds).
            start = failed.count
            for _ in range(1000):
                for entry in await client.client_list():
                    if entry.get("name") == f"okt-{broker.prefix}":
                        await client.client_kill_filter(_id=entry["id"])
                await asyncio.sleep(0.002)
                if failed.count > start:
                    return

        await relay_through(outbox, broker, [kill, kill])
        await check(outbox, broker, "client-kill-redis", 2 * BATCH, capsys)


async def test_redis_restarted_mid_relay(tmp_path, capsys):
    async with private_redis(tmp_path) as (server, broker):
        outbox = make_outbox(tmp_path, broker)
        await relay_through(outbox, broker, [server.restart])
        await check(outbox, broker, "restart-redis", BATCH, capsys)


async def test_nats_restarted_mid_relay(tmp_path, capsys):
    async with private_nats(tmp_path) as (server, broker):
        outbox = make_outbox(tmp_path, broker)
        await relay_through(outbox, broker, [server.restart])
        # Re-publishes after the restart fall inside the stream's duplicate window.
        await check(outbox, broker, "restart-nats", 0, capsys)


# -- a poller SIGKILLed mid-batch -----------------------------------------------------------------


@pytest.mark.parametrize("which", ["rabbitmq", "nats", "redis"])
async def test_a_poller_sigkilled_mid_batch(tmp_path, capsys, which):
    opener = {"rabbitmq": rabbitmq, "nats": nats_jetstream, "redis": redis_streams}[which]
    async with opener() as broker:
        outbox = make_outbox(tmp_path, broker)
        child = subprocess.Popen(
            [
                sys.executable, "-m", "tests.faults._relay_poller",
                str(tmp_path / "outbox.db"), which, broker.url, broker.prefix,
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        marker = tmp_path / "outbox.db.inflight"
        try:

            async def in_flight() -> bool:
                return marker.exists()

            await until(in_flight, 120, "the poller process to have a batch in flight")
            child.send_signal(signal.SIGKILL)
            await asyncio.to_thread(child.wait, 20)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(20)
        # A fresh poller finishes; the killed one's batch (published, never recorded) comes back
        # when its lease runs out and is published again: RabbitMQ and Redis then hold it
        # twice, a NATS stream drops the copies (Nats-Msg-Id).
        await relay_through(outbox, broker, [])
        bound = 0 if which == "nats" else BATCH
        await check(outbox, broker, f"sigkill-{which}", bound, capsys)
