"""Worker processes for the SQLite multi-process and crash tests.

Module-level functions only, so ``multiprocessing``'s ``spawn`` start method can import them. Each
worker opens its own store from ``(url, options)``, reports what it did (and every exception or
warning it saw) as JSON in ``result_path``, and gives up by itself at ``deadline`` (epoch seconds).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sqlite3
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from outboxkit import EventBus, Message, Outbox, open_store
from outboxkit.core.machine import Settlement
from outboxkit.core.model import Claim, DeadKey
from outboxkit_sqlite import SQLiteStore

LEDGER_SQL = (
    "CREATE TABLE IF NOT EXISTS ledger ("
    " event_id INTEGER NOT NULL, handler TEXT NOT NULL, pid INTEGER NOT NULL)"
)
ORDERS_SQL = "CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, publisher INTEGER)"
TOPIC = "order.placed"


class ClaimLog(SQLiteStore):
    """A SQLite store that notes, per claim, when this process surely held it.

    ``held_from`` is taken after ``claim`` returned (the lease was committed before it) and
    ``held_until`` before ``settle_many`` is called (the lease is cleared only by it), so the
    window lies inside the real lease: two windows of one event that overlap mean a double claim.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.windows: dict[str, dict[str, Any]] = {}

    def _settling(self, claim: Claim) -> None:
        window = self.windows.get(claim.token)
        if window is not None:
            window["until"] = time.time()

    def claim(
        self,
        *,
        batch_size: int,
        lease: timedelta,
        now: datetime | None,
        dead_key: DeadKey = "release",
    ) -> list[Claim]:
        claims = super().claim(batch_size=batch_size, lease=lease, now=now, dead_key=dead_key)
        held_from = time.time()
        for c in claims:
            self.windows[c.token] = {"event": c.event.id, "from": held_from, "until": None}
        return claims

    def settle_many(
        self, items: Sequence[tuple[Claim, Settlement, str | None]], *, now: datetime | None
    ) -> list[bool]:
        for claim, _, _ in items:
            self._settling(claim)
        done = super().settle_many(items, now=now)
        for (claim, _, _), ok in zip(items, done, strict=True):
            window = self.windows.get(claim.token)
            if window is not None:
                window["settled"] = ok
        return done


class _Warnings(logging.Handler):
    """Keeps every outboxkit log record at WARNING or above (handler failures, lost leases...)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def _reporting(result_path: str, result: dict[str, Any]) -> Iterator[None]:
    """Record any exception in ``result['errors']`` and write ``result`` at the end, always."""
    result.setdefault("errors", [])
    result["pid"] = os.getpid()
    warnings = _Warnings()
    logging.getLogger("outboxkit").addHandler(warnings)
    try:
        yield
    except BaseException:
        result["errors"].append(traceback.format_exc())
    finally:
        logging.getLogger("outboxkit").removeHandler(warnings)
        result["warnings"] = warnings.messages
        tmp = Path(result_path + ".tmp")
        tmp.write_text(json.dumps(result), encoding="utf-8")
        tmp.replace(result_path)


def make_bus(effects_path: str, *, asyncio: bool = False) -> tuple[EventBus, Any]:
    """Two handlers on TOPIC: ``ledger`` writes a row in its delivery transaction (``asyncio``:
    an ``async def`` on the delivery's aiosqlite connection); ``notify`` (non-transactional,
    blocking: the asyncio poller runs it in a worker thread) appends the event id to
    ``effects_path``, an effect outside the database.
    """
    bus = EventBus()
    effects = open(effects_path, "a", encoding="utf-8")  # noqa: SIM115 - closed by the caller
    row = "INSERT INTO ledger (event_id, handler, pid) VALUES (?, ?, ?)"
    pid = os.getpid()

    if asyncio:

        @bus.handler(TOPIC, name="ledger")
        async def ledger_async(event: Any, ctx: Any) -> None:
            await ctx.connection.execute(row, (event.id, "ledger", pid))

    else:

        @bus.handler(TOPIC, name="ledger")
        def ledger(event: Any, ctx: Any) -> None:
            ctx.connection.execute(row, (event.id, "ledger", pid))

    @bus.handler(TOPIC, name="notify", transactional=False)
    def notify(event: Any, ctx: Any) -> None:
        effects.write(f"{event.id}\n")
        effects.flush()

    return bus, effects


def publish(
    url: str,
    options: dict[str, Any],
    publisher: int,
    count: int,
    per_transaction: int,
    result_path: str,
    deadline: float,
) -> None:
    """Enqueue ``count`` events through the app's own sqlite3 connection, ``per_transaction``
    at a time, each transaction also inserting an ``orders`` row (alternating enqueue styles)."""
    result: dict[str, Any] = {"role": "publisher", "ids": []}
    with _reporting(result_path, result):
        store = open_store(url, **options)
        try:
            outbox = Outbox(store, EventBus(), load_entry_points=False)
            path = store.path
            with closing(sqlite3.connect(path, timeout=60)) as conn:
                sent = 0
                batch = 0
                while sent < count:
                    if time.time() > deadline:
                        raise TimeoutError(f"publisher {publisher}: deadline passed at {sent}")
                    n = min(per_transaction, count - sent)
                    order_id = publisher * 1_000_000 + batch
                    with conn:  # the app's transaction (Python's default handling)
                        conn.execute(
                            "INSERT INTO orders (id, publisher) VALUES (?, ?)",
                            (order_id, publisher),
                        )
                        if batch % 2:
                            ids = [
                                outbox.enqueue(conn, TOPIC, {"order": order_id, "n": i})
                                for i in range(n)
                            ]
                        else:
                            ids = outbox.enqueue_many(
                                conn,
                                [Message(TOPIC, {"order": order_id, "n": i}) for i in range(n)],
                            )
                    result["ids"].extend(ids)
                    sent += n
                    batch += 1
        finally:
            store.close()


def poll(
    url: str,
    options: dict[str, Any],
    done_path: str,
    effects_path: str,
    result_path: str,
    deadline: float,
    batch_size: int,
) -> None:
    """Run a poller until ``done_path`` exists and nothing is pending or claimed any more."""
    result: dict[str, Any] = {"role": "poller", "claims": [], "published": 0}
    with _reporting(result_path, result):
        store = ClaimLog.from_url(url, **options)
        bus, effects = make_bus(effects_path)
        try:
            outbox = Outbox(store, bus, load_entry_points=False)
            poller = outbox.poller(batch_size=batch_size, lease=120)
            while step := _next_step(store, poller.run_once(), result, deadline, done_path):
                if step == "wait":
                    poller.waiter.wait(0.005)
        finally:
            result["claims"] = list(store.windows.values())
            effects.close()
            store.close()


def async_poll(
    url: str,
    options: dict[str, Any],
    effects_path: str,
    result_path: str,
    deadline: float,
    batch_size: int,
    concurrency: int,
) -> None:
    """Run an asyncio poller (``concurrency`` events at once) until nothing is pending or
    claimed any more."""
    result: dict[str, Any] = {"role": "poller", "published": 0}
    with _reporting(result_path, result):
        asyncio.run(
            _async_poll(url, options, effects_path, result, deadline, batch_size, concurrency)
        )


async def _async_poll(
    url: str,
    options: dict[str, Any],
    effects_path: str,
    result: dict[str, Any],
    deadline: float,
    batch_size: int,
    concurrency: int,
) -> None:
    store = open_store(url, **options)
    bus, effects = make_bus(effects_path, asyncio=True)
    try:
        outbox = Outbox(store, bus, load_entry_points=False)
        poller = outbox.async_poller(batch_size=batch_size, lease=120, concurrency=concurrency)
        while step := _next_step(store, await poller.run_once(), result, deadline, None):
            if step == "wait":
                await poller.waiter.wait(0.005)
    finally:
        effects.close()
        store.close()


def _next_step(
    store: Any, report: Any, result: dict[str, Any], deadline: float, done_path: str | None
) -> str | None:
    """After a poller's round: poll again at once ("poll"), after a moment ("wait"), or stop
    (None: ``done_path``, if given, exists and nothing is pending or claimed any more)."""
    if time.time() > deadline:
        raise TimeoutError("poller: deadline passed")
    result["published"] += len(report.published)
    if report.failed or report.lease_lost:
        raise AssertionError(f"failed {report.failed!r}, lost {report.lease_lost!r}")
    if report.claimed:
        return "poll"
    if done_path is None or os.path.exists(done_path):
        stats = store.stats(now=None)
        if stats.pending == 0 and stats.claimed == 0:
            return None
    return "wait"


def poll_until_killed(
    url: str, options: dict[str, Any], effects_path: str, batch_size: int
) -> None:
    """A poller that runs until it is killed (the crash test SIGKILLs it mid-batch)."""
    store = open_store(url, **options)
    bus, _effects = make_bus(effects_path)
    outbox = Outbox(store, bus, load_entry_points=False)
    poller = outbox.poller(batch_size=batch_size, lease=3600)
    deadline = time.time() + 120  # never outlive a broken test run
    while time.time() < deadline:
        if not poller.run_once().claimed:
            poller.waiter.wait(0.01)
