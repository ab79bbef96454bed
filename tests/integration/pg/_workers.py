"""Poller processes for the multi-process PostgreSQL tests, and what checks their traces.

Spawn-safe: everything a child runs is a module-level function taking plain arguments. A poller
child runs ``Poller.run_forever``, or the asyncio poller's under ``asyncio.run``, on the
production path (database clock, pooled connections, LISTEN/NOTIFY) with two handlers on topic
``order``:

- ``ledger`` (transactional): one row in the ``ledger`` table, in its delivery transaction (an
  ``async def`` handler on the delivery's ``AsyncConnection`` under the asyncio poller);
- ``mailer`` (not transactional): one row in ``side_effects`` through a connection of its own,
  standing for the outside world (its duplicates after a crash are expected and counted).

Each child appends its claims (token and lease window, in the database clock), extensions and
settles to a JSON-lines file, flushed as it goes, so a SIGKILL loses at most the line in hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from outboxkit import Event, EventBus, Outbox, open_store

TOPIC = "order"
HANDLERS = ("ledger", "mailer")


def create_app_tables(conn: psycopg.Connection[Any], schema: str) -> None:
    """The app's tables: no unique constraints, so that duplicates can be counted."""
    conn.execute(
        sql.SQL("CREATE TABLE {} (event_id bigint NOT NULL, handler text NOT NULL)").format(
            sql.Identifier(schema, "ledger")
        )
    )
    conn.execute(
        sql.SQL("CREATE TABLE {} (event_id bigint NOT NULL, pid integer NOT NULL)").format(
            sql.Identifier(schema, "side_effects")
        )
    )


class _OutsideWorld:
    """The mailer's own autocommit connection, reopened when it breaks (shared by the worker
    threads the asyncio poller runs a blocking handler in)."""

    def __init__(self, url: str, schema: str) -> None:
        self.url = url
        self.conn: psycopg.Connection[Any] | None = None
        self.lock = threading.Lock()
        self.insert = sql.SQL("INSERT INTO {} (event_id, pid) VALUES (%s, %s)").format(
            sql.Identifier(schema, "side_effects")
        )

    def send(self, event_id: int) -> None:
        with self.lock:
            if self.conn is None or self.conn.closed:
                self.conn = psycopg.connect(self.url, autocommit=True, connect_timeout=5)
            conn = self.conn
        conn.execute(self.insert, (event_id, os.getpid()))

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


def make_bus(
    schema: str,
    outside: _OutsideWorld,
    topics: Iterable[str] = (TOPIC,),
    hold_dir: str | None = None,
) -> EventBus:
    """``ledger`` and ``mailer`` on each of ``topics``.

    With ``hold_dir``, the mailer of an event whose payload has ``"hold": true`` stops inside
    the handler: it creates ``HOLD-<pid>-<event id>`` there and waits (60 s at most) for a file
    ``GO`` before sending, so that a test can freeze this process mid-handler (the fault tests'
    zombie poller).
    """
    bus = EventBus()
    insert_ledger = _ledger_insert(schema)

    def ledger(event: Event, ctx: Any) -> None:
        ctx.connection.execute(insert_ledger, (event.id, "ledger"))

    def mailer(event: Event, ctx: Any) -> None:
        if hold_dir is not None and isinstance(event.payload, dict) and event.payload.get("hold"):
            Path(hold_dir, f"HOLD-{os.getpid()}-{event.id}").touch()
            go = Path(hold_dir, "GO")
            deadline = time.monotonic() + 60
            pause = threading.Event()
            while not go.exists() and time.monotonic() < deadline:
                pause.wait(0.01)
        outside.send(event.id)

    for topic in topics:
        bus.subscribe(topic, ledger, name="ledger")
        bus.subscribe(topic, mailer, name="mailer", transactional=False)
    return bus


def make_async_bus(
    schema: str, outside: _OutsideWorld, topics: Iterable[str] = (TOPIC,)
) -> EventBus:
    """``make_bus`` for the asyncio poller: ``ledger`` is an ``async def`` handler writing
    through the delivery's ``AsyncConnection``; ``mailer`` stays blocking (the poller runs it in
    a worker thread)."""
    bus = EventBus()
    insert_ledger = _ledger_insert(schema)

    async def ledger(event: Event, ctx: Any) -> None:
        await ctx.connection.execute(insert_ledger, (event.id, "ledger"))

    def mailer(event: Event, ctx: Any) -> None:
        outside.send(event.id)

    for topic in topics:
        bus.subscribe(topic, ledger, name="ledger")
        bus.subscribe(topic, mailer, name="mailer", transactional=False)
    return bus


def _ledger_insert(schema: str) -> sql.Composed:
    return sql.SQL("INSERT INTO {} (event_id, handler) VALUES (%s, %s)").format(
        sql.Identifier(schema, "ledger")
    )


class _Trace:
    """Appends what this process claimed, extended and settled to a JSON-lines file."""

    def __init__(self, path: Path, lease: timedelta) -> None:
        self.file = path.open("a", encoding="utf-8")
        self.lease = lease
        self.lock = threading.Lock()

    def write(self, lines: Iterable[dict[str, Any]]) -> None:
        with self.lock:
            for line in lines:
                self.file.write(json.dumps(line) + "\n")
            self.file.flush()

    def claimed(self, args: Any, kw: dict[str, Any], claims: Any) -> None:
        pid = os.getpid()
        self.write(
            {
                "kind": "claim",
                "event": c.event.id,
                "token": c.token,
                "start": (c.locked_until - kw["lease"]).isoformat(),
                "end": c.locked_until.isoformat(),
                "pid": pid,
                "batch": len(claims),
                "limit": kw["batch_size"],
            }
            for c in claims
        )

    def extended(self, args: Any, kw: dict[str, Any], kept: Any) -> None:
        self.write(
            {"kind": "extend", "token": c.token, "end": c.locked_until.isoformat()} for c in kept
        )

    def settled(self, args: Any, kw: dict[str, Any], done: Any) -> None:
        (items,) = args
        self.write(
            {"kind": "settle", "token": claim.token}
            for (claim, _, _), ok in zip(items, done, strict=True)
            if ok
        )

    def released(self, args: Any, kw: dict[str, Any], count: int) -> None:
        (claims,) = args
        if count:
            self.write({"kind": "release", "token": c.token} for c in claims)

    def _notes(self) -> dict[str, Any]:
        """What each traced method writes, by name: ``note(args, kwargs, result)``."""
        return {
            "claim": self.claimed,
            "extend": self.extended,
            "settle_many": self.settled,
            "release": self.released,
        }

    def wrap(self, store: Any) -> None:
        """Trace a store's claims, extensions, settlements and releases, and those of its
        per-event rounds (``Store.rounds``: the blocking poller extends and settles through
        the round, which is the store itself unless the store keeps a round of its own)."""
        notes = self._notes()
        for name, note in notes.items():
            setattr(store, name, _traced(getattr(store, name), note))
        opened = store.rounds

        @contextlib.contextmanager
        def rounds(*args: Any, **kw: Any) -> Iterator[Any]:
            with opened(*args, **kw) as round_:
                if round_ is not store:  # the store's own methods are traced already
                    for name in ("extend", "settle_many"):
                        setattr(round_, name, _traced(getattr(round_, name), notes[name]))
                yield round_

        store.rounds = rounds

    def wrap_async(self, side: Any) -> None:
        """``wrap`` for a store's asyncio side (what the asyncio poller calls)."""
        for name, note in self._notes().items():
            setattr(side, name, _traced_async(getattr(side, name), note))

    def close(self) -> None:
        self.file.close()


def _traced(method: Any, note: Any) -> Any:
    def traced(*args: Any, **kw: Any) -> Any:
        result = method(*args, **kw)
        note(args, kw, result)
        return result

    return traced


def _traced_async(method: Any, note: Any) -> Any:
    async def traced(*args: Any, **kw: Any) -> Any:
        result = await method(*args, **kw)
        note(args, kw, result)
        return result

    return traced


def run_poller(
    url: str,
    schema: str,
    side_url: str,
    trace_path: str,
    stop_path: str,
    options: dict[str, Any],
    max_seconds: float,
    topics: tuple[str, ...] = (TOPIC,),
    hold_dir: str | None = None,
    store_options: dict[str, Any] | None = None,
    asyncio_poller: bool = False,
) -> None:
    """A poller process: run until the file ``stop_path`` exists (or ``max_seconds`` pass).
    With ``asyncio_poller``, the asyncio poller (``options`` may hold ``concurrency``) under
    ``asyncio.run``, its store's asyncio side traced (``hold_dir`` is not supported there).

    Files rather than multiprocessing events: a process killed inside ``Event.wait`` or
    ``Event.set`` would leave the event's lock held and the parent waiting forever.
    """
    log_to(trace_path)
    logging.getLogger("psycopg").setLevel(logging.ERROR)
    store = open_store(url, schema=schema, **(store_options or {}))
    outside = _OutsideWorld(side_url, schema)
    if not asyncio_poller:
        outbox = Outbox(store, make_bus(schema, outside, topics, hold_dir))
        serve_traced(outbox, outside, options, trace_path, stop_path, max_seconds)
        return
    assert hold_dir is None
    outbox = Outbox(store, make_async_bus(schema, outside, topics))
    trace = _Trace(Path(trace_path), timedelta(seconds=options["lease"]))
    trace.wrap_async(store.async_store())
    try:
        asyncio.run(serve_async(outbox.async_poller(**options), trace_path, stop_path, max_seconds))
    finally:
        outside.close()
        trace.close()
        store.close()


async def serve_async(poller: Any, trace_path: str, stop_path: str, max_seconds: float) -> None:
    """``serve`` for the asyncio poller; its store's asyncio side closed at the end."""
    stop_when(poller, stop_path, max_seconds)
    try:
        await poller.run_once()
        Path(f"{trace_path}.ready").touch()
        await poller.run_forever()
    finally:
        await poller.store.close()


def log_to(trace_path: str) -> None:
    """A poller process's log (INFO and up) in ``{trace_path}.log``."""
    logging.basicConfig(
        filename=f"{trace_path}.log",
        level=logging.INFO,
        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s",
    )


def serve_traced(
    outbox: Outbox,
    outside: Any,
    options: dict[str, Any],
    trace_path: str,
    stop_path: str,
    max_seconds: float,
) -> None:
    """``serve`` a poller of ``outbox`` with its store's claims and settlements traced to
    ``trace_path``; then close ``outside`` (the handlers' world), the trace and the store."""
    store = outbox.store
    trace = _Trace(Path(trace_path), timedelta(seconds=options["lease"]))
    trace.wrap(store)
    try:
        serve(outbox.poller(**options), trace_path, stop_path, max_seconds)
    finally:
        outside.close()
        trace.close()
        store.close()


def serve(poller: Any, trace_path: str, stop_path: str, max_seconds: float) -> None:
    """Poll once, say ready (``{trace_path}.ready``), then run until the file ``stop_path``
    exists or ``max_seconds`` pass."""
    stop_when(poller, stop_path, max_seconds)
    poller.run_once()
    Path(f"{trace_path}.ready").touch()
    poller.run_forever()


def stop_when(poller: Any, stop_path: str, max_seconds: float) -> None:
    """Stop ``poller`` (from a thread of its own) once the file ``stop_path`` exists or
    ``max_seconds`` pass."""

    def watch() -> None:
        deadline = time.monotonic() + max_seconds
        pause = threading.Event()
        while not os.path.exists(stop_path) and time.monotonic() < deadline:
            pause.wait(0.1)
        poller.stop()

    threading.Thread(target=watch, daemon=True).start()


# -- what the parent checks -------------------------------------------------------------------


def count(conn: psycopg.Connection[Any], query: str, schema: str, *tables: str) -> int:
    """One integer from ``query``, its ``{}`` slots filled with ``schema``-qualified tables."""
    composed = sql.SQL(query).format(*(sql.Identifier(schema, t) for t in tables))  # type: ignore[arg-type]
    row = conn.execute(composed).fetchone()
    assert row is not None
    return int(row[0])


@dataclass(frozen=True)
class Tally:
    """What a drain left, read from the tables (``make_bus``'s two handlers)."""

    records: int  # delivery records
    incomplete: int  # events without a succeeded record of each handler
    ledger: int  # the transactional handler's rows
    distinct: int  # ... distinct by (event, handler): ledger - distinct are duplicates
    lost: int  # events without a ledger row
    side_effects: int  # the non-transactional handler's effects

    @classmethod
    def of(cls, conn: psycopg.Connection[Any], schema: str) -> Tally:
        return cls(
            records=count(conn, "SELECT count(*) FROM {}", schema, "outbox_deliveries"),
            incomplete=count(
                conn,
                "SELECT count(*) FROM {} AS e WHERE (SELECT count(DISTINCT d.handler) FROM {}"
                " AS d WHERE d.event_id = e.id AND d.outcome = 'succeeded') <> 2",
                schema,
                "outbox_events",
                "outbox_deliveries",
            ),
            ledger=count(conn, "SELECT count(*) FROM {}", schema, "ledger"),
            distinct=count(
                conn,
                "SELECT count(*) FROM (SELECT DISTINCT event_id, handler FROM {}) AS l",
                schema,
                "ledger",
            ),
            lost=count(
                conn,
                "SELECT count(*) FROM {} AS e WHERE NOT EXISTS"
                " (SELECT 1 FROM {} AS l WHERE l.event_id = e.id)",
                schema,
                "outbox_events",
                "ledger",
            ),
            side_effects=count(conn, "SELECT count(*) FROM {}", schema, "side_effects"),
        )


@dataclass
class Window:
    event: int
    token: str
    start: datetime
    end: datetime
    pid: int
    ended_early: bool = False  # settled or released: a new claim may legally start before `end`


def read_traces(paths: Iterable[Path]) -> list[Window]:
    windows: dict[str, Window] = {}
    early: set[str] = set()
    for path in paths:
        for raw in path.read_text(encoding="utf-8").splitlines():
            try:
                line = json.loads(raw)
            except ValueError:  # a line cut short by SIGKILL
                continue
            if line["kind"] == "claim":
                windows[line["token"]] = Window(
                    event=line["event"],
                    token=line["token"],
                    start=datetime.fromisoformat(line["start"]),
                    end=datetime.fromisoformat(line["end"]),
                    pid=line["pid"],
                )
            elif line["kind"] == "extend":
                window = windows.get(line["token"])
                if window is not None:
                    window.end = max(window.end, datetime.fromisoformat(line["end"]))
            else:
                early.add(line["token"])
    for token in early:
        if token in windows:
            windows[token].ended_early = True
    return list(windows.values())


def lease_overlaps(windows: Iterable[Window]) -> list[tuple[Window, Window]]:
    """Pairs of claims of one event whose live leases overlapped.

    A claim's lease runs from ``start`` to ``end`` (after extensions), unless it was settled or
    released first: then a later claim may start before ``end`` and nothing can be said.
    """
    by_event: dict[int, list[Window]] = {}
    for window in windows:
        by_event.setdefault(window.event, []).append(window)
    overlaps: list[tuple[Window, Window]] = []
    for claims in by_event.values():
        claims.sort(key=lambda w: w.start)
        for i, earlier in enumerate(claims):
            overlaps.extend(
                (earlier, later)
                for later in claims[i + 1 :]
                if later.start < earlier.end and not earlier.ended_early
            )
    return overlaps


class Fleet:
    """Poller processes (spawned), killed and respawned at will; all gone after ``shutdown``."""

    def __init__(
        self,
        url: str,
        schema: str,
        trace_dir: Path,
        options: dict[str, Any],
        *,
        side_url: str | None = None,
        max_seconds: float = 150.0,
        topics: tuple[str, ...] = (TOPIC,),
        hold_dir: Path | None = None,
        store_options: dict[str, Any] | None = None,
        asyncio_poller: bool = False,
    ) -> None:
        self.context = multiprocessing.get_context("spawn")
        self.store_options = store_options or {}
        self.asyncio_poller = asyncio_poller  # the asyncio poller in each process
        self.url = url
        self.schema = schema
        self.side_url = side_url or url
        self.trace_dir = trace_dir
        self.options = options
        self.max_seconds = max_seconds
        self.topics = topics
        self.hold_dir = hold_dir
        self.stop_path = trace_dir / "STOP"
        self.processes: list[Any] = []
        self.readies: list[Path] = []
        self.kills = 0

    def spawn(self) -> Any:
        path = self.trace_dir / f"poller-{len(self.processes)}.jsonl"
        process = self.context.Process(
            target=run_poller,
            args=(
                self.url,
                self.schema,
                self.side_url,
                str(path),
                str(self.stop_path),
                self.options,
                self.max_seconds,
                self.topics,
                None if self.hold_dir is None else str(self.hold_dir),
                self.store_options,
                self.asyncio_poller,
            ),
            daemon=True,
        )
        process.start()
        self.processes.append(process)
        self.readies.append(Path(f"{path}.ready"))
        return process

    def wait_ready(self, timeout: float) -> bool:
        """Every poller spawned so far has made its first poll."""
        return wait_until(lambda: all(r.exists() for r in self.readies), timeout, step=0.05)

    def live(self) -> list[Any]:
        return [p for p in self.processes if p.is_alive()]

    def kill(self, process: Any) -> None:
        os.kill(process.pid, signal.SIGKILL)
        process.join(10)
        self.kills += 1

    def shutdown(self, timeout: float = 30.0) -> list[int | None]:
        """Ask every poller to stop, wait for them, kill what is left; the exit codes."""
        self.stop_path.touch()
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(10)
        return [p.exitcode for p in self.processes]

    def traces(self) -> list[Path]:
        return sorted(self.trace_dir.glob("poller-*.jsonl"))

    def logs(self) -> str:
        return "".join(
            p.read_text(encoding="utf-8") for p in sorted(self.trace_dir.glob("poller-*.log"))
        )

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown(timeout=10.0)


def wait_until(done: Any, timeout: float, step: float = 0.2) -> bool:
    """Call ``done()`` until it is true or ``timeout`` passes (orchestration, not a check)."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while time.monotonic() < deadline:
        if done():
            return True
        pause.wait(step)
    return bool(done())
