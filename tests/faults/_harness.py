"""The shared fault harness, PostgreSQL side.

N events over three topics; on each topic a transactional handler (``ledger``: one row in its
delivery transaction) and a non-transactional one (``mailer``: one row in ``side_effects`` over an
autocommit connection of its own). Poller processes are ``tests/integration/pg/_workers.Fleet``'s
(traced claims, SIGKILL/SIGSTOP-able); after the fault phase a fault-free drain runs in this
process with the same handlers; then SQL checks give one line of figures::

    lost dup_tx dup_ext stuck crash_dead overclaim p50 p99

- lost: events enqueued but never delivered to their transactional handler (or missing);
- dup_tx: extra ledger rows (a transactional handler's write done twice);
- dup_ext: extra side effects (expected only after a crash or a lost lease; bounded per test);
- stuck: events neither published nor dead after the drain;
- crash_dead: events dead-lettered (no handler here ever fails, so any is the faults' doing);
- overclaim: two live leases on one event, or a claim returning more events than its batch size;
- p50 / p99: enqueue-to-publish latency in milliseconds.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from outboxkit import Message, Outbox
from outboxkit_pg import PostgresStore
from tests.integration.pg._workers import (
    _OutsideWorld,
    lease_overlaps,
    make_bus,
    read_traces,
    wait_until,
)

TOPICS = ("order", "payment", "shipment")


@dataclass(frozen=True)
class Figures:
    lost: int
    dup_tx: int
    dup_ext: int
    stuck: int
    crash_dead: int
    overclaim: int
    p50: float
    p99: float

    def line(self) -> str:
        return (
            f"lost={self.lost} dup_tx={self.dup_tx} dup_ext={self.dup_ext} stuck={self.stuck} "
            f"crash_dead={self.crash_dead} overclaim={self.overclaim} "
            f"p50={self.p50:.0f}ms p99={self.p99:.0f}ms"
        )

    def invariants(self) -> tuple[int, int, int, int, int]:
        """What must be zero in every fault test: (lost, dup_tx, stuck, crash_dead, overclaim)."""
        return (self.lost, self.dup_tx, self.stuck, self.crash_dead, self.overclaim)


def enqueue(url: str, outbox: Outbox, count: int, *, start: int = 0, **extra: Any) -> list[int]:
    """``count`` events round-robin over TOPICS, in one app transaction; their ids."""
    messages = [
        Message(TOPICS[n % len(TOPICS)], {"n": n, **extra}) for n in range(start, start + count)
    ]
    with psycopg.connect(url) as app, app.transaction():
        return outbox.enqueue_many(app, messages)


def drain(
    url: str, schema: str, *, timeout: float, lease: float = 5.0, **store_options: Any
) -> bool:
    """Deliver everything left, fault-free, in this process with the same handlers (the real
    clock: events still leased by a dead or frozen poller are taken once their lease passes)."""
    store = PostgresStore(url, schema=schema, **store_options)
    outside = _OutsideWorld(url, schema)
    try:
        outbox = Outbox(store, make_bus(schema, outside, TOPICS))
        return drain_until_done(outbox, timeout=timeout, lease=lease)
    finally:
        outside.close()
        store.close()


def drain_until_done(outbox: Outbox, *, timeout: float, lease: float) -> bool:
    """Poll until nothing is pending or claimed (bounded by ``timeout``); True if it got there."""
    poller = outbox.poller(batch_size=100, lease=lease)

    def done() -> bool:
        while poller.run_once().claimed:
            pass
        stats = outbox.store.stats(now=None)
        return stats.pending + stats.claimed == 0

    return wait_until(done, timeout, step=0.1)


def chaos(
    fleet: Any,
    send: Any,
    *,
    events: int,
    chunk: int,
    kills: int,
    every: float,
    rng: random.Random,
    before_kill: Any = None,
) -> None:
    """The SIGKILL chaos loop: ``send(count, start)`` events in chunks spread over the kills,
    one random live poller SIGKILLed every ``every`` seconds (after ``before_kill()``, if
    given) and a new one spawned in its place."""
    started = time.monotonic()
    kill_at = [started + every * (k + 1) for k in range(kills)]
    chunk_at = started
    sent = 0
    pause = threading.Event()
    while kill_at or sent < events:
        now = time.monotonic()
        if sent < events and now >= chunk_at:
            send(min(chunk, events - sent), sent)
            sent += chunk
            chunk_at += every * kills / (events / chunk)
        if kill_at and now >= kill_at[0]:
            kill_at.pop(0)
            if before_kill is not None:
                before_kill()
            fleet.kill(rng.choice(fleet.live()))
            fleet.spawn()
        pause.wait(0.01)


def _one(admin: psycopg.Connection[Any], query: str, schema: str, *tables: str) -> Any:
    composed = sql.SQL(query).format(*(sql.Identifier(schema, t) for t in tables))
    row = admin.execute(composed).fetchone()
    assert row is not None
    return row[0]


def figures(
    admin: psycopg.Connection[Any], schema: str, expected: int, traces: Iterable[Path]
) -> Figures:
    events = _one(admin, "SELECT count(*) FROM {}", schema, "outbox_events")
    undelivered = _one(
        admin,
        "SELECT count(*) FROM {} AS e WHERE NOT EXISTS"
        " (SELECT 1 FROM {} AS l WHERE l.event_id = e.id)",
        schema,
        "outbox_events",
        "ledger",
    )
    dup_tx = _one(
        admin,
        "SELECT coalesce(sum(n - 1), 0) FROM"
        " (SELECT count(*) AS n FROM {} GROUP BY event_id, handler) AS l",
        schema,
        "ledger",
    )
    dup_ext = _one(
        admin, "SELECT count(*) - count(DISTINCT event_id) FROM {}", schema, "side_effects"
    )
    stuck = _one(
        admin,
        "SELECT count(*) FROM {} WHERE published_at IS NULL AND failed_at IS NULL",
        schema,
        "outbox_events",
    )
    dead = _one(
        admin, "SELECT count(*) FROM {} WHERE failed_at IS NOT NULL", schema, "outbox_events"
    )
    p50, p99 = admin.execute(
        sql.SQL(
            "SELECT coalesce(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms), 0),"
            " coalesce(percentile_cont(0.99) WITHIN GROUP (ORDER BY ms), 0) FROM"
            " (SELECT 1000 * extract(epoch FROM published_at - created_at) AS ms FROM {}"
            " WHERE published_at IS NOT NULL) AS t"
        ).format(sql.Identifier(schema, "outbox_events"))
    ).fetchone() or (0, 0)
    paths = list(traces)
    windows = read_traces(paths)
    overruns = sum(_batch_overruns(path) for path in paths)
    return Figures(
        lost=max(0, expected - int(events)) + int(undelivered),
        dup_tx=int(dup_tx),
        dup_ext=int(dup_ext),
        stuck=int(stuck),
        crash_dead=int(dead),
        overclaim=len(lease_overlaps(windows)) + overruns,
        p50=float(p50),
        p99=float(p99),
    )


def _batch_overruns(path: Path) -> int:
    overruns = 0
    for raw in path.read_text(encoding="utf-8").splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if line.get("kind") == "claim" and line.get("batch", 0) > line.get("limit", 1 << 30):
            overruns += 1
    return overruns


# -- helpers for the connection-level faults (terminate, restart, gap) ---------------------------


def with_application_name(url: str, name: str) -> str:
    """``url`` (a postgresql:// URL) whose sessions carry ``application_name=name``, so that a
    test can find exactly its own backends in ``pg_stat_activity``."""
    return url + ("&" if "?" in url else "?") + f"application_name={name}"


def server_answers(url: str) -> bool:
    """The server accepts a new connection and runs ``SELECT 1``."""
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=2) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error:
        return False
    return True


def wait_for_server(url: str, timeout: float) -> bool:
    """Wait (bounded) until the server answers again, e.g. after a restart."""
    return wait_until(lambda: server_answers(url), timeout, step=0.2)
