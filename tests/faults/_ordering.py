"""The per-key order checker (R15) for the fault suite: PostgreSQL and SQLite.

Publisher processes enqueue keyed events (random keys out of ``KEYS``, several per transaction,
one ``enqueue_many`` each) while poller processes deliver them through a transactional handler
(``ledger``: one row in its delivery transaction) that fails at random on its first two
attempts (retried) and notes every run's start, before doing anything, in a JSON-lines file of
its process (``runs-*.jsonl``, flushed at once, so a SIGKILL loses no run that began). The test
SIGKILLs pollers (their leases expire) and freezes others past their lease (SIGSTOP, then
SIGCONT: their leases expire under them, another poller takes the events over, and the thawed
poller is fenced).

**The commit order, recorded by the app itself.** Each publisher transaction ends, after its
``enqueue_many``, by taking the next number of a one-row app table (``app_clock``) and writing,
in the same transaction, one ``app_commits`` row per event (the number, its place in the batch,
the event id, its key). Those rows commit or vanish with the events. The numbers are the true
commit order, whatever the store does: on PostgreSQL the ``UPDATE`` of the clock row keeps it
locked until the transaction ends, so the next transaction's ``UPDATE`` waits for this commit and
reads its value (READ COMMITTED), and it cannot commit before it; on SQLite the transaction holds
the single write lock from its first insert to its commit. Within a transaction the order is
the enqueue order (R15). So a key's commit order is its events sorted by (number, place).

**What is checked**, per key, over consecutive events ``a`` then ``b`` of its commit order:

- order: ``b``'s first run started before ``a``'s first run (the acceptance figure);
- overlap: a run of ``a`` started at or after ``b``'s first run (``b`` began while ``a`` was
  unsettled: retried, leased, or run again after a lost lease).

A run starts when its delivery transaction is open (``make_bus``: the token checked, the event
held); a late run the token refuses changes nothing and is not one. Run starts are
``time.monotonic_ns()``: one clock for every process of the machine (Linux's
CLOCK_MONOTONIC), and ``a``'s last run starts before its publish commits, which comes before
``b`` can be claimed. Then the harness figures (``lost``, ``dup_tx``, ``stuck``, ``crash_dead``,
``overclaim``; ``tests/faults/_harness``).

Spawn-safe: everything a child runs is a module-level function taking plain arguments.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import signal
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from outboxkit import Event, EventBus, Message, Outbox, open_store
from outboxkit.core.backoff import ExponentialBackoff
from outboxkit_sqlite import SQLiteStore
from tests.faults._harness_sqlite import APP_TIMEOUT
from tests.integration.pg._workers import Fleet, log_to, read_traces, serve_traced, wait_until
from tests.integration.sqlite._workers import _reporting

TOPIC = "account"
KEYS = 200
PER_TRANSACTION = 10
FAIL_RATE = 0.15  # chance that a run fails, on an event's first and second attempts only
BACKOFF = ExponentialBackoff(base=0.05, max=0.2)


def key_name(n: int) -> str:
    return f"k{n:03d}"


def fails(event_id: int, attempt: int) -> bool:
    """Whether this run of the handler fails: fixed by (event, attempt), the same in every
    process, never from the third attempt on (so nothing dies of it)."""
    if attempt > 2:
        return False
    digest = hashlib.blake2b(f"{event_id}:{attempt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < FAIL_RATE


class RunLog:
    """Appends one JSON line per handler run (event, key, attempt, start, failed), flushed
    before the handler writes anything."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", encoding="utf-8")
        self.lock = threading.Lock()

    def started(self, event: Event, failed: bool) -> None:
        line = {
            "event": event.id,
            "key": event.key,
            "attempt": event.attempts,
            "t": time.monotonic_ns(),
            "failed": failed,
        }
        with self.lock:
            self.file.write(json.dumps(line) + "\n")
            self.file.flush()

    def close(self) -> None:
        self.file.close()


class HandlerFailure(RuntimeError):
    """The injected failure (retried by the poller)."""


def make_bus(runs: RunLog, insert_ledger: Any) -> EventBus:
    """``ledger`` on TOPIC: take the delivery transaction, note the run, write the ledger row,
    then fail if ``fails`` says so (the row rolls back with the delivery transaction).

    A run is noted once its transaction is open: taking ``ctx.connection`` checks the claim's
    token and holds the event (the row locked on PostgreSQL, the write lock on SQLite), so no
    other poller can take it over while the run lasts. A poller frozen between its lease check
    and the handler's first line, resumed after another took the event over, is refused there
    (a stale token: the run can change nothing) and notes nothing; noted before it, such a run
    would count as an overlap that no write of it could make."""
    bus = EventBus()

    def ledger(event: Event, ctx: Any) -> None:
        failed = fails(event.id, event.attempts)
        conn = ctx.connection  # LeaseLostError on a stale token: this run changes nothing
        runs.started(event, failed)
        conn.execute(*insert_ledger(event.id))
        if failed:
            raise HandlerFailure(f"injected failure of event {event.id}, attempt {event.attempts}")

    bus.subscribe(TOPIC, ledger, name="ledger")
    return bus


def pg_ledger(schema: str) -> Any:
    insert = sql.SQL("INSERT INTO {} (event_id, handler) VALUES (%s, %s)").format(
        sql.Identifier(schema, "ledger")
    )
    return lambda event_id: (insert, (event_id, "ledger"))


def sqlite_ledger(event_id: int) -> tuple[str, tuple[Any, ...]]:
    return (
        "INSERT INTO ledger (event_id, handler, pid) VALUES (?, ?, ?)",
        (event_id, "ledger", os.getpid()),
    )


def outbox_for(store: Any, runs: RunLog, insert_ledger: Any) -> Outbox:
    return Outbox(
        store,
        make_bus(runs, insert_ledger),
        backoff=BACKOFF,
        max_retries=10,
        load_entry_points=False,
    )


# -- the app's tables ---------------------------------------------------------------------------


def create_pg_tables(conn: psycopg.Connection[Any], schema: str) -> None:
    """The commit log and its clock (the harness's ``ledger`` is created by the caller)."""
    conn.execute(
        sql.SQL("CREATE TABLE {} (n bigint NOT NULL)").format(sql.Identifier(schema, "app_clock"))
    )
    conn.execute(sql.SQL("INSERT INTO {} VALUES (0)").format(sql.Identifier(schema, "app_clock")))
    conn.execute(
        sql.SQL(
            "CREATE TABLE {} (n bigint NOT NULL, pos integer NOT NULL, event_id bigint NOT NULL,"
            " key text NOT NULL)"
        ).format(sql.Identifier(schema, "app_commits"))
    )


def create_sqlite_tables(path: Path) -> None:
    with closing(sqlite3.connect(path, timeout=APP_TIMEOUT)) as conn, conn:
        conn.execute("CREATE TABLE app_clock (n INTEGER NOT NULL)")
        conn.execute("INSERT INTO app_clock VALUES (0)")
        conn.execute(
            "CREATE TABLE app_commits (n INTEGER NOT NULL, pos INTEGER NOT NULL,"
            " event_id INTEGER NOT NULL, key TEXT NOT NULL)"
        )


def batch(rng: random.Random) -> list[Message]:
    keys = [key_name(rng.randrange(KEYS)) for _ in range(PER_TRANSACTION)]
    return [Message(TOPIC, {"key": k}, key=k) for k in keys]


# -- child processes ----------------------------------------------------------------------------


def publish_loop(
    count: int,
    seed: int,
    deadline: float,
    result: dict[str, Any],
    commit: Callable[[list[Message]], list[int]],
) -> None:
    """``count`` keyed events, PER_TRANSACTION per ``commit(messages) -> ids`` (one app
    transaction each); the ids in ``result["ids"]``; a TimeoutError past ``deadline``."""
    rng = random.Random(seed)
    sent = 0
    while sent < count:
        if time.time() > deadline:
            raise TimeoutError(f"publisher: deadline passed at {sent} of {count}")
        ids = commit(batch(rng)[: count - sent])
        result["ids"].extend(ids)
        sent += len(ids)


def publish_pg(
    url: str, schema: str, seed: int, count: int, result_path: str, deadline: float
) -> None:
    """A PostgreSQL publisher (``publish_loop``): each transaction ends with its app_commits
    rows (see the module docstring)."""
    result: dict[str, Any] = {"role": "publisher", "ids": []}
    with _reporting(result_path, result):
        store = open_store(url, schema=schema)
        tick = sql.SQL("UPDATE {} SET n = n + 1 RETURNING n").format(
            sql.Identifier(schema, "app_clock")
        )
        note = sql.SQL(
            "INSERT INTO {} (n, pos, event_id, key) SELECT %s, p, e, k"
            " FROM unnest(%s::integer[], %s::bigint[], %s::text[]) AS u(p, e, k)"
        ).format(sql.Identifier(schema, "app_commits"))
        try:
            outbox = Outbox(store, EventBus(), load_entry_points=False)
            with psycopg.connect(url) as app:

                def commit(messages: list[Message]) -> list[int]:
                    with app.transaction():
                        ids = outbox.enqueue_many(app, messages)
                        row = app.execute(tick).fetchone()
                        assert row is not None
                        keys = [m.key for m in messages]
                        app.execute(note, (row[0], list(range(len(ids))), ids, keys))
                    return ids

                publish_loop(count, seed, deadline, result, commit)
        finally:
            store.close()


def publish_sqlite(
    url: str,
    store_options: dict[str, Any],
    seed: int,
    count: int,
    result_path: str,
    deadline: float,
) -> None:
    """``publish_pg`` on SQLite, through the app's own ``sqlite3`` connection."""
    result: dict[str, Any] = {"role": "publisher", "ids": []}
    with _reporting(result_path, result):
        store = SQLiteStore.from_url(url, **store_options)
        try:
            outbox = Outbox(store, EventBus(), load_entry_points=False)
            assert store.path is not None
            with closing(sqlite3.connect(store.path, timeout=APP_TIMEOUT)) as conn:

                def commit(messages: list[Message]) -> list[int]:
                    with conn:  # the app's transaction (Python's default handling)
                        ids = outbox.enqueue_many(conn, messages)
                        conn.execute("UPDATE app_clock SET n = n + 1")
                        (n,) = conn.execute("SELECT n FROM app_clock").fetchone()
                        conn.executemany(
                            "INSERT INTO app_commits (n, pos, event_id, key) VALUES (?, ?, ?, ?)",
                            [
                                (n, p, i, m.key)
                                for p, (i, m) in enumerate(zip(ids, messages, strict=True))
                            ],
                        )
                    return ids

                publish_loop(count, seed, deadline, result, commit)
        finally:
            store.close()


def run_pg_poller(
    url: str,
    schema: str,
    trace_path: str,
    stop_path: str,
    options: dict[str, Any],
    max_seconds: float,
) -> None:
    """A PostgreSQL poller process (``_workers.serve_traced``) with the ordering bus."""
    log_to(trace_path)
    runs = RunLog(Path(trace_path.replace("poller-", "runs-")))
    outbox = outbox_for(open_store(url, schema=schema), runs, pg_ledger(schema))
    serve_traced(outbox, runs, options, trace_path, stop_path, max_seconds)


def run_sqlite_poller(
    url: str,
    store_options: dict[str, Any],
    trace_path: str,
    stop_path: str,
    options: dict[str, Any],
    max_seconds: float,
) -> None:
    """``run_pg_poller`` on SQLite."""
    log_to(trace_path)
    runs = RunLog(Path(trace_path.replace("poller-", "runs-")))
    outbox = outbox_for(SQLiteStore.from_url(url, **store_options), runs, sqlite_ledger)
    serve_traced(outbox, runs, options, trace_path, stop_path, max_seconds)


class OrderingFleet(Fleet):
    """``_workers.Fleet`` (spawn, kill, respawn, shutdown, traces) with the ordering pollers
    (``run_pg_poller``, or ``run_sqlite_poller`` when ``store_options`` is given), plus
    publisher processes and freezing a poller past its lease."""

    def __init__(
        self,
        url: str,
        schema: str,
        trace_dir: Path,
        options: dict[str, Any],
        *,
        sqlite_options: dict[str, Any] | None = None,
        max_seconds: float = 300.0,
    ) -> None:
        super().__init__(url, schema, trace_dir, options, max_seconds=max_seconds)
        self.sqlite_options = sqlite_options
        self.publishers: list[Any] = []
        self.freezes = 0

    def spawn(self) -> Any:
        path = str(self.trace_dir / f"poller-{len(self.processes)}.jsonl")
        common = (path, str(self.stop_path), self.options, self.max_seconds)
        if self.sqlite_options is None:
            target, args = run_pg_poller, (self.url, self.schema, *common)
        else:
            target, args = run_sqlite_poller, (self.url, self.sqlite_options, *common)
        process = self.context.Process(target=target, args=args, daemon=True)
        process.start()
        self.processes.append(process)
        self.readies.append(Path(f"{path}.ready"))
        return process

    def publish(self, seed: int, count: int, deadline: float) -> None:
        """Start a publisher process of ``count`` events (its result in ``publisher-<seed>``)."""
        result = str(self.trace_dir / f"publisher-{seed}.json")
        if self.sqlite_options is None:
            target: Any = publish_pg
            args: tuple[Any, ...] = (self.url, self.schema, seed, count, result, deadline)
        else:
            target = publish_sqlite
            args = (self.url, self.sqlite_options, seed, count, result, deadline)
        process = self.context.Process(target=target, args=args, daemon=True)
        process.start()
        self.publishers.append(process)

    def publishing(self) -> bool:
        return any(p.is_alive() for p in self.publishers)

    def published(self) -> list[dict[str, Any]]:
        """The publishers' results (ids, errors, warnings), once they have ended."""
        for process in self.publishers:
            process.join(60)
        return [
            json.loads(path.read_text(encoding="utf-8"))
            for path in sorted(self.trace_dir.glob("publisher-*.json"))
        ]

    def freeze(self, process: Any, seconds: float) -> None:
        """SIGSTOP ``process`` for ``seconds`` (past its lease), then SIGCONT."""
        os.kill(process.pid, signal.SIGSTOP)
        threading.Event().wait(seconds)  # fault injection: the frozen span, not a check
        os.kill(process.pid, signal.SIGCONT)
        self.freezes += 1

    def stopped_holding(self, process: Any) -> bool:
        """Stop ``process`` (SIGSTOP) and tell whether its trace shows a claim in hand: stopped,
        it can neither settle it nor write more, so a kill or a freeze now leaves its lease to
        run out. If not, it goes on at once (SIGCONT) and False is returned."""
        os.kill(process.pid, signal.SIGSTOP)
        if holds(self, self.processes.index(process)):
            return True
        os.kill(process.pid, signal.SIGCONT)
        return False

    def runs(self) -> list[Path]:
        return sorted(self.trace_dir.glob("runs-*.jsonl"))

    def __exit__(self, *exc: object) -> None:
        for process in self.publishers:
            if process.is_alive():
                process.kill()
                process.join(10)
        super().__exit__(*exc)


def holding(fleet: OrderingFleet) -> list[Any]:
    """The live pollers holding a claim now, by their traces: claimed, neither settled nor
    released yet (a fault there leaves a lease to run out)."""
    return [
        process
        for index, process in enumerate(fleet.processes)
        if process.is_alive() and holds(fleet, index)
    ]


def holds(fleet: OrderingFleet, index: int) -> bool:
    """Whether poller ``index``'s trace shows a claim neither settled nor released."""
    path = fleet.trace_dir / f"poller-{index}.jsonl"
    if not path.exists():
        return False
    open_tokens: set[str] = set()
    for raw in path.read_text(encoding="utf-8").splitlines():
        try:
            line = json.loads(raw)
        except ValueError:  # a line being written
            continue
        if line["kind"] == "claim":
            open_tokens.add(line["token"])
        elif line["kind"] in ("settle", "release"):
            open_tokens.discard(line["token"])
    return bool(open_tokens)


def holding_victim(fleet: OrderingFleet, rng: random.Random, *, within: float) -> Any:
    """A poller to fault: one holding a claim, looked for during ``within`` seconds (a fault
    on an idle poller would leave no lease to expire), else any live one."""
    deadline = time.monotonic() + within
    pause = threading.Event()
    while time.monotonic() < deadline:
        busy = holding(fleet)
        if busy:
            return rng.choice(busy)
        pause.wait(0.02)  # the fault schedule, not a check
    return rng.choice(fleet.live())


def chaos(
    fleet: OrderingFleet,
    *,
    kills: int,
    freezes: int,
    every: float,
    freeze_for: float,
    rng: random.Random,
    timeout: float,
) -> None:
    """From the first claim on (while the publishers run, and at least ``kills + freezes``
    rounds): SIGKILL a live poller and spawn a new one, or freeze one past its lease, in a
    shuffled order until both counts are spent, ``every`` seconds apart. Each fault goes to a
    poller holding a claim (``holding_victim``); the first waits for one (the fleet's first
    claims), and the victim is checked once stopped (``stopped_holding``), so the faults
    leave leases to run out however fast the fleet drains."""
    plan = ["kill"] * kills + ["freeze"] * freezes
    rng.shuffle(plan)
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    first = True
    while plan and time.monotonic() < deadline:
        fault = plan.pop()
        within = min(timeout, 30.0) if first else every
        victim = holding_victim(fleet, rng, within=within)
        first = False
        # A fault checks its victim once stopped, and tries again on a holder (until ``within``
        # runs out): a fast drain settles its claims between the look at the traces and the
        # signal, and a fault on a poller that holds nothing leaves no lease to expire.
        tries_until = time.monotonic() + within
        while not fleet.stopped_holding(victim):
            if time.monotonic() >= tries_until:
                victim = rng.choice(fleet.live())
                break
            victim = holding_victim(fleet, rng, within=max(0.0, tries_until - time.monotonic()))
        if fault == "kill":
            fleet.kill(victim)  # a stopped process is killed as any
            fleet.spawn()
        else:
            fleet.freeze(victim, freeze_for)  # stopped already, or stopped now
        pause.wait(every)  # the fault schedule, not a check


@dataclass(frozen=True)
class FleetRun:
    """What the fault phase left: publishers' results, pollers' exit codes, faults, files."""

    published: list[dict[str, Any]]
    exit_codes: list[int | None]
    kills: int
    freezes: int
    traces: list[Path]
    runs: list[Path]


def run_fleet(
    fleet: OrderingFleet,
    settled: Callable[[], bool],
    *,
    pollers: int,
    publishers: int,
    events: int,
    kills: int,
    freezes: int,
    every: float,
    freeze_for: float,
    timeout: float,
    rng: random.Random,
) -> FleetRun:
    """The fault phase: ``pollers`` pollers, ``publishers`` publishers of ``events`` in all,
    ``chaos``; then (bounded by ``timeout``) until ``settled()`` (nothing pending or leased),
    the fleet delivering the rest by itself; then the fleet's shutdown."""
    for _ in range(pollers):
        fleet.spawn()
    assert fleet.wait_ready(60), "poller processes did not start"
    deadline = time.time() + timeout
    for seed in range(publishers):
        fleet.publish(seed, events // publishers, deadline)
    chaos(
        fleet,
        kills=kills,
        freezes=freezes,
        every=every,
        freeze_for=freeze_for,
        rng=rng,
        timeout=timeout,
    )
    published = fleet.published()
    wait_until(settled, timeout, step=0.5)
    exit_codes = fleet.shutdown()
    return FleetRun(published, exit_codes, fleet.kills, fleet.freezes, fleet.traces(), fleet.runs())


# -- what the parent checks ---------------------------------------------------------------------


@dataclass(frozen=True)
class OrderFigures:
    keys: int  # keys with at least one event
    runs: int  # handler runs noted
    retries: int  # runs that failed on purpose (each retried)
    order: int  # pairs (a, b) of a key where b first ran before a
    overlap: int  # pairs where a ran at or after b's first run
    unrun: int  # events never run
    expired: (
        int  # claims never settled nor released: leases run out under a killed or frozen poller
    )

    def line(self) -> str:
        return (
            f"keys={self.keys} runs={self.runs} retries={self.retries} expired={self.expired} "
            f"order_violations={self.order} overlaps={self.overlap} unrun={self.unrun}"
        )


def read_runs(paths: Iterable[Path]) -> dict[int, list[int]]:
    """Each event's run starts (monotonic ns), from every ``runs-*.jsonl``; also the count of
    failed runs under the key ``-1`` (a line cut short by SIGKILL is skipped: it ran nothing)."""
    starts: dict[int, list[int]] = {}
    failed = 0
    for path in paths:
        for raw in path.read_text(encoding="utf-8").splitlines():
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            starts.setdefault(int(line["event"]), []).append(int(line["t"]))
            failed += bool(line["failed"])
    starts[-1] = [failed]
    return starts


def order_figures(
    commits: Iterable[tuple[int, int, int, str]], paths: Iterable[Path], traces: Iterable[Path]
) -> OrderFigures:
    """Check the runs against the commit order (``commits`` rows are (n, pos, event id, key));
    count the expired leases in the pollers' claim ``traces``."""
    starts = read_runs(paths)
    (retries,) = starts.pop(-1)
    by_key: dict[str, list[tuple[int, int, int]]] = {}
    for n, pos, event_id, key in commits:
        by_key.setdefault(key, []).append((n, pos, event_id))
    order = overlap = unrun = 0
    for rows in by_key.values():
        rows.sort()
        events = [event_id for _, _, event_id in rows]
        unrun += sum(1 for e in events if e not in starts)
        for a, b in itertools.pairwise(events):
            if a not in starts or b not in starts:
                continue
            order += min(starts[b]) < min(starts[a])
            overlap += max(starts[a]) >= min(starts[b])
    return OrderFigures(
        keys=len(by_key),
        runs=sum(len(s) for s in starts.values()),
        retries=retries,
        order=order,
        overlap=overlap,
        unrun=unrun,
        expired=sum(1 for window in read_traces(traces) if not window.ended_early),
    )


def pg_commits(admin: psycopg.Connection[Any], schema: str) -> list[tuple[int, int, int, str]]:
    query = sql.SQL("SELECT n, pos, event_id, key FROM {}").format(
        sql.Identifier(schema, "app_commits")
    )
    return [(int(n), int(p), int(e), str(k)) for n, p, e, k in admin.execute(query)]


def sqlite_commits(path: Path) -> list[tuple[int, int, int, str]]:
    with closing(sqlite3.connect(path, timeout=APP_TIMEOUT)) as conn:
        rows = conn.execute("SELECT n, pos, event_id, key FROM app_commits").fetchall()
    return [(int(n), int(p), int(e), str(k)) for n, p, e, k in rows]
