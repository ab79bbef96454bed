"""The shared fault harness, SQLite side: the same shape as ``_harness`` (PostgreSQL).

N events over ``TOPICS``; on each topic a transactional handler (``ledger``: one row written
through ``ctx.connection`` in its delivery transaction) and a non-transactional one (``mailer``:
one row in ``side_effects`` over an autocommit connection of its own, standing for the outside
world). Poller processes are spawned by ``SQLiteFleet`` (the PostgreSQL ``Fleet`` with a SQLite
worker: traced claims, SIGKILL-able); publisher processes enqueue through the app's own
``sqlite3`` connection. After the fault phase ``drain`` delivers what is left, fault-free, in this
process with the same handlers; ``figures`` then gives the same ``Figures`` line as PostgreSQL::

    lost dup_tx dup_ext stuck crash_dead overclaim p50 p99

(see ``tests/faults/_harness`` for what each figure means). Overclaim comes from the pollers'
claim traces (``tests/integration/pg/_workers._Trace``: lease windows in the claiming process's
clock, which on one machine is the clock every SQLite poller uses).

Spawn-safe: everything a child runs is a module-level function taking plain arguments.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterable
from contextlib import closing
from pathlib import Path
from typing import Any

from outboxkit import Event, EventBus, Message, Outbox
from outboxkit_sqlite import SQLiteStore
from tests.faults._harness import TOPICS, Figures, _batch_overruns, drain_until_done
from tests.integration.pg._workers import (
    Fleet,
    lease_overlaps,
    log_to,
    read_traces,
    serve_traced,
    wait_until,
)
from tests.integration.sqlite._workers import _reporting

__all__ = [
    "TOPICS",
    "Figures",
    "SQLiteFleet",
    "create_app_tables",
    "drain",
    "enqueue",
    "figures",
    "integrity",
    "make_bus",
    "messages",
    "open_outbox_file",
    "publish",
    "run_poller",
    "traced_events",
    "wait_until",
]

APP_TIMEOUT = 60.0  # seconds the app's own connections wait for the write lock


def open_outbox_file(path: Path) -> tuple[str, dict[str, Any]]:
    """Create the outbox schema and the app's tables in ``path``; the store's URL and options."""
    with SQLiteStore(path) as store:
        url, options = store.url, dict(store.options)
    create_app_tables(path)
    return url, options


def create_app_tables(path: Path) -> None:
    """The app's tables: no unique constraints, so that duplicates can be counted."""
    with closing(sqlite3.connect(path, timeout=APP_TIMEOUT)) as conn, conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS ledger"
            " (event_id INTEGER NOT NULL, handler TEXT NOT NULL, pid INTEGER NOT NULL)"
        )
        conn.execute(
            "CREATE TABLE IF NOT EXISTS side_effects (event_id INTEGER NOT NULL, pid INTEGER NOT NULL)"
        )


class _OutsideWorld:
    """The mailer's own autocommit connection to the file (every insert commits at once)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self.conn: sqlite3.Connection | None = None

    def send(self, event_id: int) -> None:
        if self.conn is None:
            self.conn = sqlite3.connect(self.path, timeout=APP_TIMEOUT, isolation_level=None)
        self.conn.execute(
            "INSERT INTO side_effects (event_id, pid) VALUES (?, ?)", (event_id, os.getpid())
        )

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def make_bus(outside: _OutsideWorld | None, topics: Iterable[str] = TOPICS) -> EventBus:
    """``ledger`` (transactional) and ``mailer`` (not) on each of ``topics``; only ``ledger``
    without ``outside`` (a lighter bus for volume tests: one transaction per event)."""
    bus = EventBus()
    pid = os.getpid()

    def ledger(event: Event, ctx: Any) -> None:
        ctx.connection.execute(
            "INSERT INTO ledger (event_id, handler, pid) VALUES (?, ?, ?)",
            (event.id, "ledger", pid),
        )

    def mailer(event: Event, ctx: Any) -> None:
        assert outside is not None
        outside.send(event.id)

    for topic in topics:
        bus.subscribe(topic, ledger, name="ledger")
        if outside is not None:
            bus.subscribe(topic, mailer, name="mailer", transactional=False)
    return bus


def messages(count: int, *, start: int = 0) -> list[Message]:
    """``count`` events round-robin over TOPICS, numbered from ``start``."""
    return [Message(TOPICS[n % len(TOPICS)], {"n": n}) for n in range(start, start + count)]


def enqueue(path: Path, outbox: Outbox, count: int, *, start: int = 0) -> list[int]:
    """``count`` events in one transaction of the app's own connection; their ids."""
    with closing(sqlite3.connect(path, timeout=APP_TIMEOUT)) as app, app:
        return outbox.enqueue_many(app, messages(count, start=start))


# -- child processes ----------------------------------------------------------------------------


def run_poller(
    url: str,
    store_options: dict[str, Any],
    trace_path: str,
    stop_path: str,
    options: dict[str, Any],
    max_seconds: float,
) -> None:
    """A poller process: ``run_forever`` until the file ``stop_path`` exists (or ``max_seconds``
    pass), its claims traced to ``trace_path`` and its log (INFO) to ``trace_path.log``."""
    log_to(trace_path)
    store = SQLiteStore.from_url(url, **store_options)
    assert store.path is not None
    outside = _OutsideWorld(store.path)
    outbox = Outbox(store, make_bus(outside), load_entry_points=False)
    serve_traced(outbox, outside, options, trace_path, stop_path, max_seconds)


def publish(
    url: str,
    store_options: dict[str, Any],
    start: int,
    count: int,
    per_transaction: int,
    result_path: str,
    deadline: float,
) -> None:
    """A publisher process: events ``start .. start + count`` through the app's own connection,
    ``per_transaction`` per transaction; its ids, errors and outboxkit warnings go (as JSON) to
    ``result_path`` (``tests/integration/sqlite/_workers._reporting``)."""
    result: dict[str, Any] = {"role": "publisher", "ids": []}
    with _reporting(result_path, result):
        store = SQLiteStore.from_url(url, **store_options)
        try:
            outbox = Outbox(store, EventBus(), load_entry_points=False)
            assert store.path is not None
            with closing(sqlite3.connect(store.path, timeout=APP_TIMEOUT)) as conn:
                sent = 0
                while sent < count:
                    if time.time() > deadline:
                        raise TimeoutError(f"publisher: deadline passed at {sent} of {count}")
                    n = min(per_transaction, count - sent)
                    with conn:  # the app's transaction (Python's default handling)
                        ids = outbox.enqueue_many(conn, messages(n, start=start + sent))
                    result["ids"].extend(ids)
                    sent += n
        finally:
            store.close()


class SQLiteFleet(Fleet):
    """``tests/integration/pg/_workers.Fleet`` (spawn, kill, respawn, shutdown, traces, logs)
    with SQLite poller processes (``run_poller``)."""

    def __init__(
        self,
        url: str,
        store_options: dict[str, Any],
        trace_dir: Path,
        options: dict[str, Any],
        *,
        max_seconds: float = 90.0,
    ) -> None:
        super().__init__(url, "", trace_dir, options, max_seconds=max_seconds, topics=TOPICS)
        self.store_options = store_options

    def spawn(self) -> Any:
        path = self.trace_dir / f"poller-{len(self.processes)}.jsonl"
        process = self.context.Process(
            target=run_poller,
            args=(
                self.url,
                self.store_options,
                str(path),
                str(self.stop_path),
                self.options,
                self.max_seconds,
            ),
            daemon=True,
        )
        process.start()
        self.processes.append(process)
        self.readies.append(Path(f"{path}.ready"))
        return process


# -- in this process, after the faults ----------------------------------------------------------


def drain(path: Path, *, timeout: float, lease: float = 5.0) -> bool:
    """Deliver everything left, fault-free, in this process with the same handlers (the real
    clock: events still leased by a killed poller are taken once their lease passes)."""
    outside = _OutsideWorld(path)
    with SQLiteStore(path) as store:
        try:
            outbox = Outbox(store, make_bus(outside), load_entry_points=False)
            return drain_until_done(outbox, timeout=timeout, lease=lease)
        finally:
            outside.close()


def traced_events(traces: Iterable[Path]) -> set[int]:
    """The events the traced pollers claimed (a check that the traces saw the work)."""
    return {window.event for window in read_traces(traces)}


def integrity(path: Path) -> str:
    """``PRAGMA integrity_check`` of the file ("ok" when sound)."""
    with closing(sqlite3.connect(path, timeout=APP_TIMEOUT)) as conn:
        return "; ".join(str(row[0]) for row in conn.execute("PRAGMA integrity_check"))


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (PostgreSQL's ``percentile_cont``)."""
    if not sorted_values:
        return 0.0
    rank = q * (len(sorted_values) - 1)
    low = int(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def figures(path: Path, expected: int, traces: Iterable[Path]) -> Figures:
    with closing(sqlite3.connect(path, timeout=APP_TIMEOUT)) as conn:

        def one(query: str) -> int:
            row = conn.execute(query).fetchone()
            assert row is not None
            return int(row[0] or 0)

        events = one("SELECT count(*) FROM outbox_events")
        undelivered = one(
            "SELECT count(*) FROM outbox_events WHERE id NOT IN (SELECT event_id FROM ledger)"
        )
        dup_tx = one(
            "SELECT coalesce(sum(n - 1), 0) FROM"
            " (SELECT count(*) AS n FROM ledger GROUP BY event_id, handler)"
        )
        dup_ext = one("SELECT count(*) - count(DISTINCT event_id) FROM side_effects")
        stuck = one(
            "SELECT count(*) FROM outbox_events WHERE published_at IS NULL AND failed_at IS NULL"
        )
        dead = one("SELECT count(*) FROM outbox_events WHERE failed_at IS NOT NULL")
        latencies = sorted(
            (published - created) / 1000.0
            for created, published in conn.execute(
                "SELECT created_at, published_at FROM outbox_events WHERE published_at IS NOT NULL"
            )
        )
    paths = list(traces)
    overruns = sum(_batch_overruns(p) for p in paths)
    return Figures(
        lost=max(0, expected - events) + undelivered,
        dup_tx=dup_tx,
        dup_ext=dup_ext,
        stuck=stuck,
        crash_dead=dead,
        overclaim=len(lease_overlaps(read_traces(paths))) + overruns,
        p50=_percentile(latencies, 0.5),
        p99=_percentile(latencies, 0.99),
    )
