"""outboxkit against the minimal loop a user could write, and against pgqueuer and procrastinate.

Every contender drains ``--events`` freshly enqueued events to a no-op handler, on a fresh
schema (PostgreSQL), a fresh database (the peers) or a fresh file (SQLite), in spawned
processes that connect first and wait at a start barrier; the time is from the first
process's first claim to the last one's last settle (enqueue and setup excluded). Each round
runs every contender once, the order rotating from round to round; the figures are each
contender's median events/s and the ratio outboxkit / reference of the medians.

    python bench/compare.py                        # everything, 10,000 events, 3 rounds
    python bench/compare.py --events 2000 --rounds 1 --only pg-tx-1 --only sqlite-event
    python bench/compare.py --json                 # machine-readable
    python bench/compare.py --update-readme        # rewrite the table in bench/README.md
    python bench/compare.py --statements           # statements and round trips per event
    python bench/compare.py --only pg-batch-2 --ref-handler-us 8   # see below

The references (one table of events, one of delivery records, no token, no foreign key):

- per event: claim 100 with ``FOR UPDATE SKIP LOCKED`` (lease, attempts + 1); per event
  ``BEGIN``, the handler, ``INSERT`` a record, ``COMMIT`` (non-transactional: the record
  ``INSERT`` in autocommit after the handler); then mark the batch published in one statement;
- per batch: one transaction per batch: claim, the handlers, ``executemany`` of the records,
  mark;
- SQLite (WAL, ``synchronous=NORMAL``, as outboxkit's store): the same, with
  ``BEGIN IMMEDIATE``.
- MariaDB/MySQL (``mysql-event``, ``mysql-batch``; ``bench/_mysql.py``): the same shapes, each
  handler writing one row in the delivery's transaction; ``OUTBOXKIT_BENCH_MYSQL_URL``.

``--bare`` adds outboxkit's own statements (its stores' SQL, in its pipeline syncs) sent by a
plain loop with no poller: for the no-op handler, and for the handler that writes a row
(``bare-w-*``: per event the delivery transaction's three syncs, per batch its savepoints), the
ratio the database itself gives the work outboxkit's rules ask of it. No reference either.

``--ref-handler-us N`` is no reference: the minimal loops' handler then spends N µs of CPU per
event, which shows how far a poller's own per-event Python moves a ratio. Nor is
``--ref-claim-probe``: the PostgreSQL minimal loops then claim as outboxkit does, reaching the
picked rows by primary key (``WHERE id = ANY(ARRAY(SELECT id FROM due))``) instead of joining the
CTE, which a prepared claim plans as a hash over a scan of the whole table while the table is
small (10,000 rows here); it shows how much of a ratio is that plan.

The asyncio poller runs per event at concurrency 1, 4 and 16 (transactional and not) and in
``per_batch`` (``kit-async-batch``: the records of handlers that never take the connection
written with the batch's settlement, as pgqueuer writes its acknowledgements in batches); the
table names the contender each best figure came from.

The peers: pgqueuer (asyncpg driver, ``QueueExecutionMode.drain``, batch 10 - its default - and
100) and procrastinate (a worker with ``wait=False``, its defaults otherwise), each in a
database of its own with its schema installed through its own API.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import re
import secrets
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

from _common import fill_outbox, median, pg_schema, pg_url_default

from outboxkit.storekit.rows import EVENT_COLUMNS

TOKEN = len(EVENT_COLUMNS)
"""Where a claimed row's token is: right after the event's columns (outboxkit.storekit.sql)."""

TOPIC = "bench.compare"
HANDLER = "noop"
BATCH = 100
TIMEOUT = 900.0  # seconds one contender's drain may take before it is abandoned
README = Path(__file__).with_name("README.md")
BEGIN_MARK = "<!-- compare:begin -->"
END_MARK = "<!-- compare:end -->"


# -- contenders -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Contender:
    name: str
    label: str
    backend: str  # "pg" | "sqlite" | "mysql" | "pgqueuer" | "procrastinate"
    kind: str  # "ref" | "kit" | "async" | "peer"
    mode: str = "tx"  # "tx" | "nontx" | "batch" | "batch-sp" (a minimal loop's savepoints)
    processes: int = 1
    concurrency: int = 1  # the poller's concurrency (asyncio: events at once)
    batch_size: int = BATCH
    prefetch: bool = False  # the poller's prefetch option (the next claim during a batch)
    # The handler writes one row of its own (``app_rows``) in the delivery's transaction:
    # outboxkit's through ``ctx.connection``, the minimal loops' on their connection.
    writes: bool = False


def _writing(name: str, label: str, backend: str, kind: str, mode: str, *rest: Any) -> Contender:
    return Contender(
        name, f"{label}, handler writes a row", backend, kind, mode, *rest, writes=True
    )


# A handler that writes one row: the transactional handler's path (issue: the delivery record
# commits with the handler's writes). The minimal loops: per event ``BEGIN; INSERT row; INSERT
# record; COMMIT``; per batch one transaction, a savepoint per handler (``batch-sp``: a failing
# handler undoes only its own writes, as outboxkit's per_batch keeps) or none (``batch``).
WRITING = [
    _writing("ref-w-tx-1", "minimal loop, tx per event", "pg", "ref", "tx", 1),
    _writing("ref-w-tx-2", "minimal loop, tx per event, 2 procs", "pg", "ref", "tx", 2),
    _writing("ref-w-batch-sp", "minimal loop, tx per batch, savepoints", "pg", "ref", "batch-sp"),
    _writing("ref-w-batch", "minimal loop, tx per batch, no savepoints", "pg", "ref", "batch"),
    _writing("kit-w-tx-1", "poller, per_event", "pg", "kit", "tx", 1),
    _writing("kit-w-tx-2", "poller, per_event, 2 procs", "pg", "kit", "tx", 2),
    _writing("kit-w-batch-1", "poller, per_batch", "pg", "kit", "batch", 1),
    _writing("kit-w-async-1", "async_poller c=1", "pg", "async", "tx", 1, 1),
    _writing("kit-w-async-4", "async_poller c=4", "pg", "async", "tx", 1, 4),
    _writing("kit-w-async-16", "async_poller c=16", "pg", "async", "tx", 1, 16),
    _writing("ref-w-sqlite-tx", "minimal loop, tx per event", "sqlite", "ref", "tx"),
    _writing(
        "ref-w-sqlite-batch-sp",
        "minimal loop, tx per batch, savepoints",
        "sqlite",
        "ref",
        "batch-sp",
    ),
    _writing(
        "ref-w-sqlite-batch", "minimal loop, tx per batch, no savepoints", "sqlite", "ref", "batch"
    ),
    _writing("kit-w-sqlite-tx", "poller, per_event", "sqlite", "kit", "tx"),
    _writing("kit-w-sqlite-batch", "poller, per_batch", "sqlite", "kit", "batch"),
    # --bare: outboxkit's own statements for these, sent by a plain loop (no poller): what the
    # database gives for the work outboxkit's rules ask of it, with the handler's row.
    _writing("bare-w-tx-1", "outboxkit's statements, per event", "pg", "bare", "tx", 1),
    _writing("bare-w-tx-2", "outboxkit's statements, per event, 2 procs", "pg", "bare", "tx", 2),
    _writing("bare-w-batch-1", "outboxkit's statements, per batch", "pg", "bare", "batch", 1),
    _writing("bare-w-sqlite-tx", "outboxkit's statements, per event", "sqlite", "bare", "tx"),
    _writing("bare-w-sqlite-batch", "outboxkit's statements, per batch", "sqlite", "bare", "batch"),
]
W_ASYNC = ["kit-w-async-1", "kit-w-async-4", "kit-w-async-16"]

CONTENDERS = {
    c.name: c
    for c in [
        Contender("ref-tx-1", "minimal loop, tx per event", "pg", "ref", "tx", 1),
        Contender("ref-tx-2", "minimal loop, tx per event, 2 procs", "pg", "ref", "tx", 2),
        Contender("ref-nontx-1", "minimal loop, autocommit record", "pg", "ref", "nontx", 1),
        Contender("ref-batch-1", "minimal loop, tx per batch", "pg", "ref", "batch", 1),
        Contender("ref-batch-2", "minimal loop, tx per batch, 2 procs", "pg", "ref", "batch", 2),
        Contender("kit-tx-1", "poller, per_event", "pg", "kit", "tx", 1),
        Contender("kit-tx-2", "poller, per_event, 2 procs", "pg", "kit", "tx", 2),
        Contender("kit-nontx-1", "poller, non-transactional", "pg", "kit", "nontx", 1),
        Contender("kit-batch-1", "poller, per_batch", "pg", "kit", "batch", 1),
        Contender("kit-batch-2", "poller, per_batch, 2 procs", "pg", "kit", "batch", 2),
        Contender(
            "kit-batch-1p", "poller, per_batch, prefetch", "pg", "kit", "batch", 1, prefetch=True
        ),
        Contender(
            "kit-batch-2p",
            "poller, per_batch, prefetch, 2 procs",
            "pg",
            "kit",
            "batch",
            2,
            prefetch=True,
        ),
        Contender("kit-tx-c4", "poller, per_event, concurrency 4", "pg", "kit", "tx", 1, 4),
        Contender(
            "kit-tx-c3p",
            "poller, per_event, concurrency 3, prefetch",
            "pg",
            "kit",
            "tx",
            1,
            3,
            prefetch=True,
        ),
        Contender("kit-async-1", "async_poller c=1", "pg", "async", "tx", 1, 1),
        Contender("kit-async-4", "async_poller c=4", "pg", "async", "tx", 1, 4),
        Contender("kit-async-16", "async_poller c=16", "pg", "async", "tx", 1, 16),
        Contender("kit-async-nontx-4", "async_poller c=4, non-tx", "pg", "async", "nontx", 1, 4),
        Contender("kit-async-nontx-16", "async_poller c=16, non-tx", "pg", "async", "nontx", 1, 16),
        Contender("kit-async-batch", "async_poller, per_batch", "pg", "async", "batch", 1, 1),
        Contender("bare-tx-1", "outboxkit's statements, per event", "pg", "bare", "tx", 1),
        Contender("bare-tx-2", "outboxkit's statements, per event, 2 procs", "pg", "bare", "tx", 2),
        Contender("bare-batch-1", "outboxkit's statements, per batch", "pg", "bare", "batch", 1),
        Contender(
            "bare-batch-2", "outboxkit's statements, per batch, 2 procs", "pg", "bare", "batch", 2
        ),
        Contender("pgqueuer-10", "pgqueuer, batch 10", "pgqueuer", "peer", batch_size=10),
        Contender("pgqueuer-100", "pgqueuer, batch 100", "pgqueuer", "peer", batch_size=100),
        Contender("procrastinate", "procrastinate worker", "procrastinate", "peer"),
        Contender("ref-sqlite-tx", "minimal loop, tx per event", "sqlite", "ref", "tx"),
        Contender("ref-sqlite-batch", "minimal loop, tx per batch", "sqlite", "ref", "batch"),
        Contender("kit-sqlite-tx", "poller, per_event", "sqlite", "kit", "tx"),
        Contender("kit-sqlite-batch", "poller, per_batch", "sqlite", "kit", "batch"),
        Contender("bare-sqlite-tx", "outboxkit's statements, per event", "sqlite", "bare", "tx"),
        Contender(
            "bare-sqlite-batch", "outboxkit's statements, per batch", "sqlite", "bare", "batch"
        ),
        *WRITING,
        Contender("ref-mysql-tx", "minimal loop, tx per event, 1-row handler", "mysql", "ref"),
        Contender(
            "ref-mysql-batch-sp",
            "minimal loop, tx per batch, a savepoint per handler, 1-row handler",
            "mysql",
            "ref",
            "batch-sp",
        ),
        Contender(
            "ref-mysql-batch", "minimal loop, tx per batch, 1-row handler", "mysql", "ref", "batch"
        ),
        Contender("kit-mysql-tx", "poller, per_event, 1-row handler", "mysql", "kit"),
        Contender("kit-mysql-batch", "poller, per_batch, 1-row handler", "mysql", "kit", "batch"),
    ]
}

# The asyncio poller per event; ``ASYNC`` adds it in ``per_batch``.
ASYNC_EVENT = [
    "kit-async-1",
    "kit-async-4",
    "kit-async-16",
    "kit-async-nontx-4",
    "kit-async-nontx-16",
]
ASYNC = [*ASYNC_EVENT, "kit-async-batch"]
CONCURRENT = ["kit-tx-c4", "kit-tx-c3p"]  # the blocking poller committing several at once
# Contenders that are compared with one another run next to one another.
GROUPS: list[list[str]] = [
    ["ref-tx-1", "kit-tx-1", "bare-tx-1", "pgqueuer-10", *CONCURRENT, *ASYNC],
    ["ref-nontx-1", "kit-nontx-1", "procrastinate"],
    ["ref-tx-2", "kit-tx-2", "bare-tx-2"],
    ["ref-batch-1", "kit-batch-1", "kit-batch-1p", "bare-batch-1", "pgqueuer-100"],
    ["ref-batch-2", "kit-batch-2", "kit-batch-2p", "bare-batch-2"],
    ["ref-sqlite-tx", "kit-sqlite-tx", "bare-sqlite-tx"],
    ["ref-sqlite-batch", "kit-sqlite-batch", "bare-sqlite-batch"],
    ["ref-w-tx-1", "kit-w-tx-1", *W_ASYNC, "bare-w-tx-1"],
    ["ref-w-tx-2", "kit-w-tx-2", "bare-w-tx-2"],
    ["ref-w-batch-sp", "ref-w-batch", "kit-w-batch-1", "bare-w-batch-1"],
    ["ref-w-sqlite-tx", "kit-w-sqlite-tx", "bare-w-sqlite-tx"],
    ["ref-w-sqlite-batch-sp", "ref-w-sqlite-batch", "kit-w-sqlite-batch", "bare-w-sqlite-batch"],
    ["ref-mysql-tx", "kit-mysql-tx"],
    ["ref-mysql-batch-sp", "ref-mysql-batch", "kit-mysql-batch"],
]


@dataclass(frozen=True)
class Workload:
    name: str
    label: str
    reference: str
    outboxkit: tuple[str, ...]  # the best of these is compared
    target: float | None


WORKLOADS = [
    Workload("pg-tx-1", "PG transactional, 1 poller", "ref-tx-1", ("kit-tx-1",), 0.9),
    Workload("pg-tx-2", "PG transactional, 2 pollers", "ref-tx-2", ("kit-tx-2",), 0.9),
    Workload("pg-nontx-1", "PG non-transactional, 1 poller", "ref-nontx-1", ("kit-nontx-1",), 0.9),
    Workload(
        "pg-batch-1", "PG per_batch, 1 poller", "ref-batch-1", ("kit-batch-1", "kit-batch-1p"), 0.8
    ),
    Workload(
        "pg-batch-2", "PG per_batch, 2 pollers", "ref-batch-2", ("kit-batch-2", "kit-batch-2p"), 0.8
    ),
    Workload(
        "pgqueuer-default",
        "best per-event vs pgqueuer (batch 10)",
        "pgqueuer-10",
        ("kit-tx-1", "kit-nontx-1", *CONCURRENT, *ASYNC_EVENT),
        1.0,
    ),
    Workload(
        "pgqueuer-async",
        "asyncio poller, no-op async handler, at its best (concurrency, or per_batch) vs "
        "pgqueuer (batch 10)",
        "pgqueuer-10",
        tuple(ASYNC),
        1.0,
    ),
    Workload(
        "pgqueuer-async-event",
        "asyncio poller per event, no-op async handler, at its best concurrency vs pgqueuer "
        "(batch 10)",
        "pgqueuer-10",
        tuple(ASYNC_EVENT),
        None,
    ),
    Workload(
        "pgqueuer-batch",
        "per_batch vs pgqueuer (batch 100)",
        "pgqueuer-100",
        ("kit-batch-1", "kit-batch-1p"),
        1.0,
    ),
    Workload(
        "procrastinate", "transactional vs procrastinate", "procrastinate", ("kit-tx-1",), None
    ),
    Workload("sqlite-event", "SQLite per event", "ref-sqlite-tx", ("kit-sqlite-tx",), 0.9),
    Workload("sqlite-batch", "SQLite per_batch", "ref-sqlite-batch", ("kit-sqlite-batch",), 0.8),
    Workload("pg-w-tx-1", "PG handler writes, 1 poller", "ref-w-tx-1", ("kit-w-tx-1",), 0.9),
    Workload("pg-w-tx-2", "PG handler writes, 2 pollers", "ref-w-tx-2", ("kit-w-tx-2",), 0.9),
    Workload(
        "pg-w-batch-sp",
        "PG handler writes, per_batch vs savepoint loop",
        "ref-w-batch-sp",
        ("kit-w-batch-1",),
        0.9,
    ),
    Workload(
        "pg-w-batch",
        "PG handler writes, per_batch vs loop without savepoints",
        "ref-w-batch",
        ("kit-w-batch-1",),
        0.6,
    ),
    Workload(
        "pg-w-async",
        "PG handler writes, async_poller vs the per-event loop",
        "ref-w-tx-1",
        tuple(W_ASYNC),
        0.9,
    ),
    Workload(
        "sqlite-w-event",
        "SQLite handler writes, per event",
        "ref-w-sqlite-tx",
        ("kit-w-sqlite-tx",),
        0.9,
    ),
    Workload(
        "sqlite-w-batch-sp",
        "SQLite handler writes, per_batch vs savepoint loop",
        "ref-w-sqlite-batch-sp",
        ("kit-w-sqlite-batch",),
        None,
    ),
    Workload(
        "sqlite-w-batch",
        "SQLite handler writes, per_batch vs loop without savepoints",
        "ref-w-sqlite-batch",
        ("kit-w-sqlite-batch",),
        0.6,
    ),
    Workload(
        "mysql-event", "MariaDB per event, 1-row handler", "ref-mysql-tx", ("kit-mysql-tx",), 0.8
    ),
    Workload(
        "mysql-batch-sp",
        "MariaDB per_batch, 1-row handler, vs savepoint loop",
        "ref-mysql-batch-sp",
        ("kit-mysql-batch",),
        0.8,
    ),
    Workload(
        "mysql-batch",
        "MariaDB per_batch, 1-row handler, vs loop without savepoints",
        "ref-mysql-batch",
        ("kit-mysql-batch",),
        None,
    ),
]
# --bare: what the database itself gives for outboxkit's statements, against the same references.
BARE_WORKLOADS = [
    Workload(name, label, reference, (contender,), None)
    for name, label, reference, contender in [
        ("bare-tx-1", "PG transactional, 1 poller, bare", "ref-tx-1", "bare-tx-1"),
        ("bare-tx-2", "PG transactional, 2 pollers, bare", "ref-tx-2", "bare-tx-2"),
        ("bare-batch-1", "PG per_batch, 1 poller, bare", "ref-batch-1", "bare-batch-1"),
        ("bare-batch-2", "PG per_batch, 2 pollers, bare", "ref-batch-2", "bare-batch-2"),
        ("bare-sqlite-event", "SQLite per event, bare", "ref-sqlite-tx", "bare-sqlite-tx"),
        ("bare-sqlite-batch", "SQLite per_batch, bare", "ref-sqlite-batch", "bare-sqlite-batch"),
        ("bare-w-tx-1", "PG handler writes, 1 poller, bare", "ref-w-tx-1", "bare-w-tx-1"),
        ("bare-w-tx-2", "PG handler writes, 2 pollers, bare", "ref-w-tx-2", "bare-w-tx-2"),
        (
            "bare-w-batch-sp",
            "PG handler writes, per_batch vs savepoint loop, bare",
            "ref-w-batch-sp",
            "bare-w-batch-1",
        ),
        (
            "bare-w-batch",
            "PG handler writes, per_batch vs loop without savepoints, bare",
            "ref-w-batch",
            "bare-w-batch-1",
        ),
        (
            "bare-w-sqlite-event",
            "SQLite handler writes, per event, bare",
            "ref-w-sqlite-tx",
            "bare-w-sqlite-tx",
        ),
        (
            "bare-w-sqlite-batch",
            "SQLite handler writes, per_batch vs loop without savepoints, bare",
            "ref-w-sqlite-batch",
            "bare-w-sqlite-batch",
        ),
    ]
]
WORKLOAD_NAMES = [w.name for w in WORKLOADS + BARE_WORKLOADS]

PEER_MODULES = {"pgqueuer": ("pgqueuer", "asyncpg"), "procrastinate": ("procrastinate",)}


def missing_peer(backend: str) -> str | None:
    """The first module a peer needs that is not installed, or None."""
    for module in PEER_MODULES.get(backend, ()):
        if importlib.util.find_spec(module) is None:
            return module
    return None


# -- the references' tables and statements ----------------------------------------------------

PG_REF_DDL = """
CREATE TABLE {s}.ref_events (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic text NOT NULL,
    payload jsonb NOT NULL,
    attempts integer NOT NULL DEFAULT 0,
    leased_until timestamptz,
    published_at timestamptz
);
CREATE INDEX ON {s}.ref_events (id) WHERE published_at IS NULL;
CREATE TABLE {s}.ref_records (
    event_id bigint NOT NULL,
    handler text NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (event_id, handler)
);
"""
# The table a writing handler writes its one row to (``Contender.writes``), on both sides.
PG_APP_DDL = """
CREATE TABLE {s}.app_rows (
    event_id bigint PRIMARY KEY,
    written_at timestamptz NOT NULL DEFAULT now()
)
"""
PG_APP_ROW = "INSERT INTO {s}.app_rows (event_id) VALUES (%s)"
PG_REF_FILL = """
INSERT INTO {s}.ref_events (topic, payload)
SELECT %(topic)s, jsonb_build_object('n', g) FROM generate_series(1, %(n)s) AS g
"""
PG_REF_CLAIM = """
WITH due AS (
    SELECT id FROM {s}.ref_events
     WHERE published_at IS NULL AND (leased_until IS NULL OR leased_until < now())
     ORDER BY id LIMIT %(batch)s
       FOR UPDATE SKIP LOCKED
)
UPDATE {s}.ref_events AS e
   SET leased_until = now() + interval '30 seconds', attempts = e.attempts + 1
  FROM due WHERE e.id = due.id
RETURNING e.id, e.topic, e.payload
"""
# --ref-claim-probe (no reference): the same claim reaching its rows as outboxkit's claim does,
# by primary key, instead of joining the CTE (which a prepared claim plans as a hash over a scan
# of the whole table while the table is small).
PG_REF_CLAIM_PROBE = PG_REF_CLAIM.replace(
    "  FROM due WHERE e.id = due.id", " WHERE e.id = ANY(ARRAY(SELECT id FROM due))"
)
assert PG_REF_CLAIM_PROBE != PG_REF_CLAIM
PG_REF_RECORD = "INSERT INTO {s}.ref_records (event_id, handler) VALUES (%s, %s)"
PG_REF_MARK = """
UPDATE {s}.ref_events SET published_at = now(), leased_until = NULL WHERE id = ANY(%s)
"""

SQLITE_REF_DDL = """
CREATE TABLE ref_events (
    id INTEGER PRIMARY KEY,
    topic TEXT NOT NULL,
    payload TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    leased_until REAL,
    published_at REAL
);
CREATE INDEX ref_due ON ref_events (id) WHERE published_at IS NULL;
CREATE TABLE ref_records (
    event_id INTEGER NOT NULL,
    handler TEXT NOT NULL,
    recorded_at REAL NOT NULL,
    PRIMARY KEY (event_id, handler)
);
"""
SQLITE_APP_DDL = """
CREATE TABLE app_rows (event_id INTEGER PRIMARY KEY, written_at REAL NOT NULL)
"""
SQLITE_APP_ROW = "INSERT INTO app_rows (event_id, written_at) VALUES (?, ?)"
SQLITE_REF_CLAIM = """
UPDATE ref_events SET leased_until = :until, attempts = attempts + 1
 WHERE id IN (SELECT id FROM ref_events
               WHERE published_at IS NULL AND (leased_until IS NULL OR leased_until < :now)
               ORDER BY id LIMIT :batch)
RETURNING id, topic, payload
"""
SQLITE_REF_RECORD = "INSERT INTO ref_records (event_id, handler, recorded_at) VALUES (?, ?, ?)"
SQLITE_REF_MARK = """
UPDATE ref_events SET published_at = :now, leased_until = NULL
 WHERE id IN (SELECT value FROM json_each(:ids))
"""


def _pg(statement: str, schema: str) -> Any:
    """``statement`` with ``{s}`` filled in by the schema, quoted as an identifier."""
    from psycopg import sql

    return sql.SQL(statement).format(s=sql.Identifier(schema))


# -- workers (spawned processes) ----------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    contender: Contender
    target: str  # PG URL, or SQLite file
    schema: str = ""  # PG schema of the store and the reference tables
    # Called as the drain ends, before the worker closes its connections (a worker run in this
    # process: cpu_split.py reads the server's CPU then, while the backends still live).
    on_end: Callable[[], object] | None = None


def _end(job: Job) -> float:
    """The drain's end (``time.monotonic``), after which ``job.on_end`` is called."""
    ended = time.monotonic()
    if job.on_end is not None:
        job.on_end()
    return ended


@dataclass
class Drained:
    started: float
    ended: float
    handled: int  # handler calls in this process


REF_HANDLER_ENV = "OUTBOXKIT_COMPARE_REF_HANDLER_US"
REF_CLAIM_PROBE_ENV = "OUTBOXKIT_COMPARE_REF_CLAIM_PROBE"
_REF_HANDLER_SECONDS = float(os.environ.get(REF_HANDLER_ENV) or 0) / 1_000_000


def noop(*_: object) -> None:
    """The handler: it does nothing (the caller counts its calls)."""


def ref_handler(*_: object) -> None:
    """The minimal loops' handler: nothing, or with ``--ref-handler-us N`` N microseconds of
    CPU (a busy loop on the monotonic counter)."""
    if _REF_HANDLER_SECONDS:
        end = time.perf_counter() + _REF_HANDLER_SECONDS
        while time.perf_counter() < end:
            pass


def ref_claim() -> str:
    """The PostgreSQL minimal loops' claim: ``PG_REF_CLAIM``, or with ``--ref-claim-probe``
    (in a spawned worker: its environment) ``PG_REF_CLAIM_PROBE``."""
    return PG_REF_CLAIM_PROBE if os.environ.get(REF_CLAIM_PROBE_ENV) == "1" else PG_REF_CLAIM


def _pg_ref_worker(job: Job, barrier: Barrier) -> Drained:
    import psycopg

    c = job.contender
    claim = _pg(ref_claim(), job.schema)
    mark = _pg(PG_REF_MARK, job.schema)
    record = _pg(PG_REF_RECORD, job.schema)
    handled = 0
    with psycopg.connect(job.target, autocommit=True) as conn:
        app_row = _pg(PG_APP_ROW, job.schema).as_bytes(conn)

        def handle(event_id: int, topic: str, payload: Any) -> None:
            ref_handler(event_id, topic, payload)
            if c.writes:
                conn.execute(app_row, (event_id,))

        barrier.wait()
        started = time.monotonic()
        while True:
            if c.mode in ("batch", "batch-sp"):
                with conn.transaction():
                    rows = conn.execute(claim, {"batch": c.batch_size}).fetchall()
                    for event_id, topic, payload in rows:
                        if c.mode == "batch-sp":
                            with conn.transaction():  # a savepoint: a failure undoes its own
                                handle(event_id, topic, payload)
                        else:
                            handle(event_id, topic, payload)
                    with conn.cursor() as cur:
                        cur.executemany(record, [(row[0], HANDLER) for row in rows])
                    conn.execute(mark, ([row[0] for row in rows],))
            else:
                rows = conn.execute(claim, {"batch": c.batch_size}).fetchall()
                for event_id, topic, payload in rows:
                    if c.mode == "tx":
                        with conn.transaction():
                            handle(event_id, topic, payload)
                            conn.execute(record, (event_id, HANDLER))
                    else:
                        handle(event_id, topic, payload)
                        conn.execute(record, (event_id, HANDLER))
                if rows:
                    conn.execute(mark, ([row[0] for row in rows],))
            if not rows:
                break
            handled += len(rows)
        ended = _end(job)
    return Drained(started, ended, handled)


def _sqlite_connect(path: str) -> sqlite3.Connection:
    """A connection at the SQLite store's settings (WAL, ``synchronous=NORMAL``), autocommit."""
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


def _sqlite_ref_worker(job: Job, barrier: Barrier) -> Drained:
    c = job.contender
    conn = _sqlite_connect(job.target)
    handled = 0

    def handle(event_id: int, topic: str, payload: Any) -> None:
        ref_handler(event_id, topic, payload)
        if c.writes:
            conn.execute(SQLITE_APP_ROW, (event_id, time.time()))

    barrier.wait()
    started = time.monotonic()
    while True:
        now = time.time()
        claim = {"now": now, "until": now + 30, "batch": c.batch_size}
        if c.mode in ("batch", "batch-sp"):
            conn.execute("BEGIN IMMEDIATE")
            rows = conn.execute(SQLITE_REF_CLAIM, claim).fetchall()
            for event_id, topic, payload in rows:
                if c.mode == "batch-sp":  # a savepoint: a failure undoes its own writes
                    conn.execute("SAVEPOINT handler")
                    handle(event_id, topic, json.loads(payload))
                    conn.execute("RELEASE handler")
                else:
                    handle(event_id, topic, json.loads(payload))
            conn.executemany(SQLITE_REF_RECORD, [(row[0], HANDLER, now) for row in rows])
            ids = json.dumps([row[0] for row in rows])
            conn.execute(SQLITE_REF_MARK, {"now": time.time(), "ids": ids})
            conn.execute("COMMIT")
        else:
            conn.execute("BEGIN IMMEDIATE")
            rows = conn.execute(SQLITE_REF_CLAIM, claim).fetchall()
            conn.execute("COMMIT")
            for event_id, topic, payload in rows:
                conn.execute("BEGIN IMMEDIATE")
                handle(event_id, topic, json.loads(payload))
                conn.execute(SQLITE_REF_RECORD, (event_id, HANDLER, time.time()))
                conn.execute("COMMIT")
            if rows:
                ids = json.dumps([row[0] for row in rows])
                conn.execute(SQLITE_REF_MARK, {"now": time.time(), "ids": ids})
        if not rows:
            break
        handled += len(rows)
    ended = _end(job)
    conn.close()
    return Drained(started, ended, handled)


def _fenced_record(event_id: int, token: Any, attempt: int, now: Any) -> dict[str, Any]:
    """``insert_record_fenced``'s parameters for a success (``insert_record`` reads the same,
    all but the token)."""
    return {
        "event_id": event_id,
        "token": token,
        "handler": HANDLER,
        "outcome": "succeeded",
        "attempt": attempt,
        "now": now,
        "reason": None,
    }


def _pg_bare_store(job: Job) -> tuple[Any, Any, Any]:
    """A bare PostgreSQL loop's store (for its statements), their texts, the claim's values."""
    from outboxkit_pg import PostgresStore

    store = PostgresStore(job.target, schema=job.schema, notify=False)
    _, claim_params = store.statements.claim_query(
        job.contender.batch_size, datetime.timedelta(seconds=30), None, "release"
    )
    return store, store.dialect.queries, claim_params


def _pg_claims(conn: Any, claim: Any, params: Any) -> Iterator[list[Any]]:
    """The claimed batches, one after another, until a claim finds none."""
    while rows := conn.execute(claim, params).fetchall():
        yield rows


def _bare_worker(job: Job, barrier: Barrier) -> Drained:
    """outboxkit's own statements (its store's SQL, its pipeline syncs), sent by a plain loop:
    no poller, no handler dispatch, no observers - what the database gives for its work."""
    import psycopg

    c = job.contender
    store, q, claim_params = _pg_bare_store(job)
    handled = 0
    with psycopg.connect(job.target, autocommit=True) as conn:
        barrier.wait()
        started = time.monotonic()
        for rows in _pg_claims(conn, q["claim"], claim_params):
            batched = c.mode == "batch"
            kept: list[tuple[Any, ...]] = []
            for row in rows:
                event_id, attempt, token = row[0], row[7], row[TOKEN]
                noop(event_id, json.loads(row[2]))
                # The handler never takes the connection: its record is one statement that
                # checks the token (insert_record_fenced), or kept for the batch's end.
                if batched:
                    kept.append((event_id, token, HANDLER, "succeeded", attempt, None, None))
                else:
                    record = _fenced_record(event_id, token, attempt, None)
                    conn.execute(q["insert_record_fenced"], record)
            # The round's settlement: every event published (outboxkit's publish_many), with
            # the batch's kept records in the same statement (publish_recording), which is the
            # batch's one transaction (no handler took the connection: no BEGIN, no COMMIT).
            settle: dict[str, Any] = {
                "now": None,
                "ids": [row[0] for row in rows],
                "tokens": [row[TOKEN] for row in rows],
            }
            if kept:
                settle["record_ids"] = [k[0] for k in kept]
                settle["handlers"] = [k[2] for k in kept]
                conn.execute(q["publish_recording"], settle)
            else:
                conn.execute(q["publish_many"], settle)
            handled += len(rows)
        ended = _end(job)
    store.close()
    return Drained(started, ended, handled)


# The savepoint a delivery's records are written behind, as outboxkit_pg.flow sends it (a name
# private to flow: spelled here, for the bare loops of this script and pg_delivery_cost.py).
PG_RECORDS_SAVEPOINT = b"SAVEPOINT outboxkit_records"


def _bare_writing_worker(job: Job, barrier: Barrier) -> Drained:
    """outboxkit's statements for a handler that writes one row, in outboxkit's pipeline syncs
    (sent by its own flight sender, ``outboxkit_pg.pipeline.fly``), by a plain loop: the
    claim; per event ``BEGIN`` with the token check and row lock (``lock_for_delivery``, the
    commit guard's touch), the handler's ``INSERT`` (a sync of its own, through psycopg, as a
    handler sends it), then ``RESET ROLE``, the records' savepoint, ``close_delivery`` (R17's
    check, the record, R18's reset) and ``COMMIT``; the round's settlement. ``per_batch``
    (``batch``): one transaction, the guard's touch once, per event the savepoint with
    ``lock_in_batch``, the ``INSERT``, then the closing with the savepoint's release; the
    settlement and ``COMMIT`` together. No poller, no dispatch, no reports: what the
    database gives for the work outboxkit's rules ask of it."""
    import psycopg

    from outboxkit_pg.flow import RESET_ROLE, SAVEPOINT, TRANSACTION, Statement
    from outboxkit_pg.pipeline import fly
    from outboxkit_pg.pool import SET_UTC

    store, q, claim_params = _pg_bare_store(job)
    batched = job.contender.mode == "batch"
    handled = 0

    def closing(event_id: int, attempt: int) -> list[Statement]:
        record = {
            "event_id": event_id,
            "handler": HANDLER,
            "outcome": "succeeded",
            "attempt": attempt,
            "now": None,
            "reason": None,
            "last": True,
            "utc": True,
        }
        return [
            Statement(RESET_ROLE),
            Statement(PG_RECORDS_SAVEPOINT),
            Statement(q["close_delivery"], record, prepare=True),
            Statement(SAVEPOINT.end if batched else TRANSACTION.end),
        ]

    with psycopg.connect(job.target, autocommit=True) as conn:
        conn.execute(SET_UTC)
        app_row = _pg(PG_APP_ROW, job.schema).as_bytes(conn)
        barrier.wait()
        started = time.monotonic()
        for rows in _pg_claims(conn, q["claim"], claim_params):
            for n, row in enumerate(rows):
                event_id, attempt, token = row[0], row[7], row[TOKEN]
                noop(event_id, json.loads(row[2]))
                lock = {"id": event_id, "token": token, "mark": not batched}
                opening = [Statement(TRANSACTION.begin)] if not batched or n == 0 else []
                if batched:  # the guard's touch once, then the delivery's savepoint and lock
                    if n == 0:
                        opening.append(Statement(q["lock_for_delivery"], lock, prepare=True))
                    opening.append(Statement(SAVEPOINT.begin))
                    opening.append(Statement(q["lock_in_batch"], lock, prepare=True))
                else:
                    opening.append(Statement(q["lock_for_delivery"], lock, prepare=True))
                if not fly(conn, opening)[-1].rows:
                    raise RuntimeError(f"event {event_id}: stale token in the bare loop")
                conn.execute(app_row, (event_id,))  # the handler's row
                fly(conn, closing(event_id, attempt))
            settle = {
                "now": None,
                "ids": [row[0] for row in rows],
                "tokens": [row[TOKEN] for row in rows],
            }
            with conn.pipeline():  # the settlement's arrays go through psycopg
                conn.execute(q["publish_many"], settle)
                if batched:
                    conn.execute(TRANSACTION.end)
            handled += len(rows)
        ended = _end(job)
    store.close()
    return Drained(started, ended, handled)


def _sqlite_bare_claim(
    conn: sqlite3.Connection, q: Any, batch_size: int, *, commit: bool
) -> tuple[int, list[Any]]:
    """The SQLite store's claim under ``BEGIN IMMEDIATE``: its instant and rows, committed
    unless ``commit`` is false and it claimed some (the batch goes on in its transaction)."""
    now = int(time.time() * 1_000_000)
    claim = {"now": now, "lease": 30_000_000, "batch_size": batch_size, "hold": True}
    conn.execute("BEGIN IMMEDIATE")
    rows = conn.execute(q["claim"], claim).fetchall()
    if commit or not rows:
        conn.execute("COMMIT")
    return now, rows


def _bare_sqlite_worker(job: Job, barrier: Barrier) -> Drained:
    """The SQLite store's own statements, sent by a plain loop at the store's settings: the
    claim under ``BEGIN IMMEDIATE``; with the no-op handler, per event each record in one
    autocommitted statement that checks the token (``insert_record_fenced``), per batch the
    records together (``insert_records_fenced``) and the settlement in the claim's transaction.
    With the handler that writes a row (``writes``), the claim committed on its own (the
    attempt counts), then per event ``BEGIN IMMEDIATE``, the token check (``owned``), the
    handler's ``INSERT``, the record (``insert_record``) and ``COMMIT``; per batch one
    transaction: the batch's tokens checked at once (``lock_claimed``), a savepoint around
    each handler's ``INSERT``, the kept records together; then the round's settlement."""
    from outboxkit_sqlite import SQLiteStore

    c = job.contender
    store = SQLiteStore(job.target, migrate=False)
    q = store.dialect.queries
    conn = _sqlite_connect(job.target)
    batched = c.mode == "batch"
    handled = 0
    barrier.wait()
    started = time.monotonic()
    while True:
        claimed_at, rows = _sqlite_bare_claim(conn, q, c.batch_size, commit=c.writes or not batched)
        if not rows:
            break
        ids = json.dumps([row[0] for row in rows])
        tokens = json.dumps([row[TOKEN] for row in rows])
        kept: list[tuple[Any, ...]] = []
        if c.writes and batched:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(q["lock_claimed"], {"ids": ids, "tokens": tokens}).fetchall()
        for row in rows:
            event_id, attempt, token = row[0], row[7], row[TOKEN]
            noop(event_id, row[1], json.loads(row[2]))
            now = claimed_at if batched and not c.writes else int(time.time() * 1_000_000)
            if batched:
                if c.writes:  # a savepoint: a failing handler undoes only its own row
                    conn.execute("SAVEPOINT outboxkit_delivery")
                    conn.execute(SQLITE_APP_ROW, (event_id, time.time()))
                    conn.execute("RELEASE outboxkit_delivery")
                kept.append((event_id, token, HANDLER, "succeeded", attempt, now, None))
            elif c.writes:
                conn.execute("BEGIN IMMEDIATE")
                owned = conn.execute(q["owned"], {"id": event_id, "token": token}).fetchone()
                if owned is None:
                    raise RuntimeError(f"event {event_id}: stale token in the bare loop")
                conn.execute(SQLITE_APP_ROW, (event_id, time.time()))
                conn.execute(q["insert_record"], _fenced_record(event_id, token, attempt, now))
                conn.execute("COMMIT")
            else:
                conn.execute(
                    q["insert_record_fenced"], _fenced_record(event_id, token, attempt, now)
                )
        if kept:
            conn.execute(q["insert_records_fenced"], {"items": json.dumps(kept)})
        else:
            conn.execute("BEGIN IMMEDIATE")
        settle = {"now": int(time.time() * 1_000_000), "ids": ids, "tokens": tokens}
        conn.execute(q["publish_many"], settle).fetchall()
        conn.execute("COMMIT")
        handled += len(rows)
    ended = _end(job)
    conn.close()
    store.close()
    return Drained(started, ended, handled)


def _kit_outbox(job: Job, asyncio_side: bool = False) -> tuple[Any, Any, list[int]]:
    """The store, the outbox and the handler's call counter of a poller process."""
    from outboxkit import EventBus, Outbox

    c = job.contender
    calls = [0]
    bus = EventBus()
    app_row: list[Any] = []  # the row's statement, rendered once (for the connection's)
    if c.backend == "pg":
        from psycopg import sql

        composed = sql.SQL(PG_APP_ROW).format(s=sql.Identifier(job.schema))

        def row_params(event: Any) -> tuple[Any, ...]:
            return (event.id,)
    else:

        def row_params(event: Any) -> tuple[Any, ...]:
            return (event.id, time.time())

    def row_query(conn: Any) -> Any:
        if not app_row:
            app_row.append(composed.as_bytes(conn) if c.backend == "pg" else SQLITE_APP_ROW)
        return app_row[0]

    if asyncio_side:

        async def handle_async(event: Any, ctx: Any) -> None:
            calls[0] += 1
            if c.writes:
                conn = ctx.connection
                await conn.execute(row_query(conn), row_params(event))

        bus.subscribe(TOPIC, handle_async, name=HANDLER, transactional=c.mode != "nontx")
    else:

        def handle(event: Any, ctx: Any) -> None:
            calls[0] += 1
            if c.writes:
                conn = ctx.connection
                conn.execute(row_query(conn), row_params(event))

        bus.subscribe(TOPIC, handle, name=HANDLER, transactional=c.mode != "nontx")
    if c.backend == "pg":
        from outboxkit_pg import PostgresStore

        # A round holds up to pool_max_size - 2 connections (two stay free for the claims).
        pool: dict[str, Any] = (
            {"pool_max_size": max(4, c.concurrency + 2)} if c.kind == "kit" else {}
        )
        store: Any = PostgresStore(job.target, schema=job.schema, notify=False, **pool)
    else:
        from outboxkit_sqlite import SQLiteStore

        store = SQLiteStore(job.target, migrate=False)
    return store, Outbox(store, bus, load_entry_points=False), calls


def _kit_worker(job: Job, barrier: Barrier) -> Drained:
    from outboxkit.poller import ThreadWaiter

    store, outbox, calls = _kit_outbox(job)
    transaction = "per_batch" if job.contender.mode == "batch" else "per_event"
    poller = outbox.poller(
        batch_size=job.contender.batch_size,
        waiter=ThreadWaiter(),
        transaction=transaction,
        prefetch=job.contender.prefetch,
        concurrency=job.contender.concurrency,
    )
    store.stats(now=None)  # connect (and check the schema) before the clock starts
    if job.contender.backend == "pg":
        # The connections this poller holds at once (a round's for concurrency, one more for
        # a prefetched claim) are opened before the clock starts, as the minimal loop opens
        # its one: a long-running poller has them already.
        with contextlib.ExitStack() as held:
            for _ in range(job.contender.concurrency + job.contender.prefetch):
                held.enter_context(store.transaction())
    barrier.wait()
    started = time.monotonic()
    if job.contender.prefetch:
        poller.run_until_idle()  # the loop that prefetches (run_once claims one batch)
    else:
        while poller.run_once():
            pass
    ended = _end(job)
    store.close()
    return Drained(started, ended, calls[0])


def _kit_async_worker(job: Job, barrier: Barrier) -> Drained:
    from outboxkit.waiter import LoopWaiter

    store, outbox, calls = _kit_outbox(job, asyncio_side=True)
    poller = outbox.async_poller(
        concurrency=job.contender.concurrency,
        batch_size=job.contender.batch_size,
        waiter=LoopWaiter(),
        transaction="per_batch" if job.contender.mode == "batch" else "per_event",
    )

    async def drain() -> tuple[float, float]:
        try:
            async with poller.store.transaction():
                pass  # a first connection, before the clock starts
            barrier.wait()
            started = time.monotonic()
            while await poller.run_once():
                pass
            return started, time.monotonic()
        finally:
            await poller.store.close()

    started, ended = asyncio.run(drain())
    store.close()
    return Drained(started, ended, calls[0])


def asyncpg_kwargs(url: str) -> dict[str, Any]:
    """``asyncpg.connect`` arguments for a libpq URL or conninfo (options ``-c k=v`` too)."""
    from psycopg.conninfo import conninfo_to_dict

    info = conninfo_to_dict(url)
    kwargs: dict[str, Any] = {
        key: info[name]
        for key, name in [
            ("host", "host"),
            ("port", "port"),
            ("user", "user"),
            ("password", "password"),
            ("database", "dbname"),
        ]
        if info.get(name)
    }
    if "port" in kwargs:
        kwargs["port"] = int(kwargs["port"])
    options = str(info.get("options") or "")
    settings = dict(re.findall(r"-c\s*([\w.]+)=(\S+)", options))
    if settings:
        kwargs["server_settings"] = settings
    return kwargs


def _pgqueuer_worker(job: Job, barrier: Barrier) -> Drained:
    import asyncpg  # type: ignore[import-untyped]
    from pgqueuer import AsyncpgDriver, Queries, QueueManager
    from pgqueuer.types import QueueExecutionMode

    calls = [0]

    async def drain() -> tuple[float, float]:
        conn = await asyncpg.connect(**asyncpg_kwargs(job.target))
        try:
            qm = QueueManager(Queries(AsyncpgDriver(conn)))

            @qm.entrypoint(HANDLER)
            async def handle(job: Any) -> None:
                calls[0] += 1

            barrier.wait()
            started = time.monotonic()
            await qm.run(batch_size=job.contender.batch_size, mode=QueueExecutionMode.drain)
            return started, time.monotonic()
        finally:
            await conn.close()

    started, ended = asyncio.run(drain())
    return Drained(started, ended, calls[0])


def _procrastinate_app(url: str) -> tuple[Any, Any, list[int]]:
    import procrastinate

    calls = [0]
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url))

    @app.task(name=HANDLER)
    def handle() -> None:
        calls[0] += 1

    return app, handle, calls


def _procrastinate_worker(job: Job, barrier: Barrier) -> Drained:
    app, _, calls = _procrastinate_app(job.target)

    async def drain() -> tuple[float, float]:
        async with app.open_async():
            barrier.wait()
            started = time.monotonic()
            await app.run_worker_async(wait=False, install_signal_handlers=False)
            return started, time.monotonic()

    started, ended = asyncio.run(drain())
    return Drained(started, ended, calls[0])


def _worker(job: Job, barrier: Barrier, results: Any) -> None:
    c = job.contender
    run: Callable[[Job, Barrier], Drained]
    if c.backend == "mysql":
        import _mysql

        drain = _mysql.ref_worker if c.kind == "ref" else _mysql.kit_worker
        started, ended, handled = drain(job.target, c.mode, c.batch_size, barrier)
        results.put(asdict(Drained(started, ended, handled)))
        return
    if c.backend == "pgqueuer":
        run = _pgqueuer_worker
    elif c.backend == "procrastinate":
        run = _procrastinate_worker
    elif c.kind == "ref":
        run = _pg_ref_worker if c.backend == "pg" else _sqlite_ref_worker
    elif c.kind == "async":
        run = _kit_async_worker
    elif c.kind == "bare":
        run = pg_worker(c) if c.backend == "pg" else _bare_sqlite_worker
    else:
        run = _kit_worker
    try:
        results.put(asdict(run(job, barrier)))
    except BaseException as exc:
        results.put({"error": f"{c.name}: {type(exc).__name__}: {exc}"})
        barrier.abort()
        raise


def run_processes(job: Job) -> tuple[float, int]:
    """Run the contender's processes together: (seconds first start to last end, handled)."""
    n = job.contender.processes
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(n, timeout=120)
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(job, barrier, results)) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        raw = [results.get(timeout=TIMEOUT) for _ in procs]
        errors = [r["error"] for r in raw if "error" in r]
        if errors:
            raise RuntimeError("; ".join(errors))
        got = [Drained(**r) for r in raw]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
                p.join()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"{job.contender.name}: exit codes {[p.exitcode for p in procs]}")
    started = min(g.started for g in got)
    ended = max(g.ended for g in got)
    return ended - started, sum(g.handled for g in got)


# -- setup and checks (in the parent) -------------------------------------------------------------


@dataclass
class Outcome:
    """One contender's drain: its time, its handler calls, and what the database holds after."""

    name: str
    seconds: float
    handled: int
    settled: int  # events marked done
    records: int  # distinct events with a delivery record (peers: their own count of done jobs)
    written: int | None = None  # rows the handlers wrote (a writing handler's contender)

    @property
    def rate(self) -> float:
        return self.handled / self.seconds if self.seconds > 0 else float("nan")

    def problems(self, events: int) -> list[str]:
        wrong = [
            f"{what} {got}"
            for what, got in [
                ("handler calls", self.handled),
                ("settled", self.settled),
                ("recorded", self.records),
                ("rows written", events if self.written is None else self.written),
            ]
            if got != events
        ]
        return [f"{self.name}: expected {events} each, got " + ", ".join(wrong)] if wrong else []


def _fill_kit(outbox: Any, events: int) -> None:
    fill_outbox(outbox, TOPIC, events)


def _one(conn: Any, query: Any, params: Any = None) -> int:
    row = conn.execute(query, params or ()).fetchone()
    return int(row[0]) if row else 0


def prepare_pg(url: str, contender: Contender, schema: str, events: int) -> None:
    """``contender``'s tables in ``schema``, holding ``events`` due events, analyzed."""
    import psycopg

    from outboxkit import EventBus, Outbox
    from outboxkit_pg import PostgresStore

    with psycopg.connect(url, autocommit=True) as conn:
        if contender.writes:
            conn.execute(_pg(PG_APP_DDL, schema))
        if contender.kind == "ref":
            conn.execute(_pg(PG_REF_DDL, schema))
            conn.execute(_pg(PG_REF_FILL, schema), {"topic": TOPIC, "n": events})
            conn.execute(_pg("VACUUM ANALYZE {s}.ref_events", schema))
        else:
            with contextlib.closing(PostgresStore(url, schema=schema, notify=False)) as store:
                store.migrate()
                _fill_kit(Outbox(store, EventBus(), load_entry_points=False), events)
            conn.execute(_pg("VACUUM ANALYZE {s}.outbox_events", schema))


def pg_outcome(
    url: str, contender: Contender, schema: str, seconds: float, handled: int
) -> Outcome:
    """A drain of ``contender``'s in ``schema``: its time and handler calls, and what the
    tables hold after it (events settled, events recorded)."""
    import psycopg

    if contender.kind == "ref":
        settled = "SELECT count(*) FROM {s}.ref_events WHERE published_at IS NOT NULL"
        records = "SELECT count(DISTINCT event_id) FROM {s}.ref_records"
    else:
        settled = "SELECT count(*) FROM {s}.outbox_events WHERE published_at IS NOT NULL"
        records = (
            "SELECT count(DISTINCT event_id) FROM {s}.outbox_deliveries WHERE outcome = 'succeeded'"
        )
    with psycopg.connect(url, autocommit=True) as conn:
        done, recorded = _one(conn, _pg(settled, schema)), _one(conn, _pg(records, schema))
        written = (
            _one(conn, _pg("SELECT count(*) FROM {s}.app_rows", schema))
            if contender.writes
            else None
        )
    return Outcome(contender.name, seconds, handled, done, recorded, written)


def pg_worker(contender: Contender) -> Callable[[Job, Barrier], Drained]:
    """The worker that drains for a PostgreSQL contender of the minimal loop, outboxkit's
    statements or outboxkit's blocking poller (in this process, for ``--statements`` and
    ``cpu_split.py``)."""
    bare = _bare_writing_worker if contender.writes else _bare_worker
    return {"ref": _pg_ref_worker, "bare": bare}.get(contender.kind, _kit_worker)


def run_pg(contender: Contender, url: str, events: int) -> Outcome:
    with pg_schema(url, "outboxkit_compare") as schema:
        prepare_pg(url, contender, schema, events)
        seconds, handled = run_processes(Job(contender, url, schema))
        return pg_outcome(url, contender, schema, seconds, handled)


def run_sqlite(contender: Contender, events: int) -> Outcome:
    from outboxkit import EventBus, Outbox
    from outboxkit_sqlite import SQLiteStore

    with tempfile.TemporaryDirectory(prefix="outboxkit-compare-") as tmp:
        path = Path(tmp) / "bench.db"
        if contender.kind == "ref":
            with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.executescript(SQLITE_REF_DDL)
                conn.execute("BEGIN")
                conn.executemany(
                    "INSERT INTO ref_events (topic, payload) VALUES (?, ?)",
                    [(TOPIC, json.dumps({"n": n})) for n in range(events)],
                )
                conn.execute("COMMIT")
        else:
            with SQLiteStore(path) as store:
                _fill_kit(Outbox(store, EventBus(), load_entry_points=False), events)
        if contender.writes:
            with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
                conn.execute(SQLITE_APP_DDL)
        seconds, handled = run_processes(Job(contender, str(path)))
        with contextlib.closing(sqlite3.connect(path)) as conn:
            if contender.kind == "ref":
                settled = _one(
                    conn, "SELECT count(*) FROM ref_events WHERE published_at IS NOT NULL"
                )
                records = _one(conn, "SELECT count(DISTINCT event_id) FROM ref_records")
            else:
                settled = _one(
                    conn, "SELECT count(*) FROM outbox_events WHERE published_at IS NOT NULL"
                )
                records = _one(
                    conn,
                    "SELECT count(DISTINCT event_id) FROM outbox_deliveries"
                    " WHERE outcome = 'succeeded'",
                )
            written = _one(conn, "SELECT count(*) FROM app_rows") if contender.writes else None
    return Outcome(contender.name, seconds, handled, settled, records, written)


@contextlib.contextmanager
def fresh_database(url: str, prefix: str) -> Iterator[str]:
    """A fresh, empty database on the server of ``url`` (its URL), dropped afterwards."""
    import psycopg
    from psycopg import sql
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    name = f"{prefix}_{os.getpid()}_{secrets.token_hex(3)}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    info = conninfo_to_dict(url)
    info["dbname"] = name
    try:
        yield make_conninfo("", **info)
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def run_pgqueuer(contender: Contender, url: str, events: int) -> Outcome:
    import asyncpg
    import psycopg
    from pgqueuer import AsyncpgDriver, Queries

    with fresh_database(url, "outboxkit_compare_pgq") as db:

        async def setup() -> None:
            conn = await asyncpg.connect(**asyncpg_kwargs(db))
            try:
                queries = Queries(AsyncpgDriver(conn))
                await queries.install()
                for start in range(0, events, 1000):
                    n = min(events, start + 1000) - start
                    await queries.enqueue([HANDLER] * n, [None] * n, [0] * n)
            finally:
                await conn.close()

        asyncio.run(setup())
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE")
        seconds, handled = run_processes(Job(contender, db))
        with psycopg.connect(db, autocommit=True) as conn:
            left = _one(conn, "SELECT count(*) FROM pgqueuer")
            done = _one(
                conn,
                "SELECT count(DISTINCT job_id) FROM pgqueuer_log WHERE status = 'successful'",
            )
    return Outcome(contender.name, seconds, handled, events - left, done)


def run_procrastinate(contender: Contender, url: str, events: int) -> Outcome:
    import psycopg

    with fresh_database(url, "outboxkit_compare_procr") as db:
        app, task, _ = _procrastinate_app(db)

        async def setup() -> None:
            async with app.open_async():
                await app.schema_manager.apply_schema_async()
                for start in range(0, events, 1000):
                    n = min(events, start + 1000) - start
                    await task.batch_defer_async(*([{}] * n))

        asyncio.run(setup())
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE")
        seconds, handled = run_processes(Job(contender, db))
        with psycopg.connect(db, autocommit=True) as conn:
            done = _one(conn, "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'")
    return Outcome(contender.name, seconds, handled, done, done)


def run_mysql(contender: Contender, events: int) -> Outcome:
    """A MariaDB/MySQL contender's drain, in a database of its own (``bench/_mysql.py``)."""
    import _mysql

    with _mysql.fresh_database() as url:
        _mysql.prepare(url, contender.kind, events)
        seconds, handled = run_processes(Job(contender, url))
        settled, records, ledger = _mysql.counts(url, contender.kind)
    outcome = Outcome(contender.name, seconds, handled, settled, records)
    if ledger != events:
        outcome.records = min(records, ledger)  # a handler's row missing shows as a problem
    return outcome


def run_contender(contender: Contender, url: str, events: int) -> Outcome:
    if contender.backend == "mysql":
        return run_mysql(contender, events)
    if contender.backend == "pg":
        return run_pg(contender, url, events)
    if contender.backend == "sqlite":
        return run_sqlite(contender, events)
    if contender.backend == "pgqueuer":
        return run_pgqueuer(contender, url, events)
    return run_procrastinate(contender, url, events)


# -- rounds, results --------------------------------------------------------------------------


def needed(workloads: Sequence[Workload]) -> set[str]:
    return {name for w in workloads for name in (w.reference, *w.outboxkit)}


def schedule(names: set[str], round_: int) -> list[str]:
    """This round's order: the groups rotated, and the contenders within each group."""
    groups = [[n for n in g if n in names] for g in GROUPS]
    groups = [g for g in groups if g]
    if groups:
        shift = round_ % len(groups)
        groups = groups[shift:] + groups[:shift]
    order: list[str] = []
    for g in groups:
        shift = round_ % len(g)
        order += g[shift:] + g[:shift]
    return order


@dataclass
class Row:
    workload: str
    label: str
    reference: str
    ref_rate: float
    outboxkit: str
    kit_rate: float
    ratio: float
    target: float | None
    met: bool | None
    rounds: list[float] = field(default_factory=list)  # per-round ratios

    def cells(self) -> list[str]:
        return [
            self.label,
            CONTENDERS[self.reference].label,
            f"{self.ref_rate:,.0f}",
            f"{self.kit_rate:,.0f} ({CONTENDERS[self.outboxkit].label})",
            f"{self.ratio:.2f}",
            "—" if self.target is None else f"≥ {self.target:g}",
            "—" if self.met is None else ("met" if self.met else "unmet"),
        ]


HEADER = ["workload", "reference", "ref ev/s", "outboxkit ev/s", "ratio", "target", "met"]


def results_table(rows: Sequence[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines)


def summarize(workloads: Sequence[Workload], rates: dict[str, list[float]]) -> list[Row]:
    rows = []
    for w in workloads:
        ref = rates.get(w.reference) or []
        kits = {k: rates[k] for k in w.outboxkit if rates.get(k)}
        if not ref or not kits:
            continue
        best = max(kits, key=lambda k: median(kits[k]))
        ratio = median(kits[best]) / median(ref)
        rows.append(
            Row(
                w.name,
                w.label,
                w.reference,
                median(ref),
                best,
                median(kits[best]),
                ratio,
                w.target,
                None if w.target is None else ratio >= w.target,
                [k / r for k, r in zip(kits[best], ref, strict=True)],
            )
        )
    return rows


def machine(url: str) -> str:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        version = conn.execute("SHOW server_version").fetchone()
        sync = conn.execute("SHOW synchronous_commit").fetchone()
    pg = version[0].split()[0] if version else "?"
    return (
        f"{os.cpu_count()} cores, PostgreSQL {pg} (synchronous_commit={sync[0] if sync else '?'}),"
        f" Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}"
    )


def update_readme(table: str, header: str) -> None:
    text = README.read_text()
    block = f"{BEGIN_MARK}\n{header}\n\n{table}\n{END_MARK}"
    if BEGIN_MARK in text and END_MARK in text:
        before, rest = text.split(BEGIN_MARK, 1)
        after = rest.split(END_MARK, 1)[1]
        text = before + block + after
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    README.write_text(text)


def compare(
    url: str,
    events: int,
    rounds: int,
    only: Sequence[str] = (),
    say: Callable[[str], None] = print,
    bare: bool = False,
) -> tuple[list[Row], dict[str, list[Outcome]], list[str]]:
    """Run the rounds; the table's rows, every outcome by contender, and the problems seen."""
    candidates = WORKLOADS + BARE_WORKLOADS if bare or only else WORKLOADS
    workloads = [w for w in candidates if not only or w.name in only]
    names = needed(workloads)
    for backend in PEER_MODULES:
        module = missing_peer(backend)
        if module is not None and any(CONTENDERS[n].backend == backend for n in names):
            say(f"skipped: {backend} ({module} is not installed; pip install -e '.[bench]')")
            names = {n for n in names if CONTENDERS[n].backend != backend}
    outcomes: dict[str, list[Outcome]] = {}
    problems: list[str] = []
    for round_ in range(rounds):
        for name in schedule(names, round_):
            outcome = run_contender(CONTENDERS[name], url, events)
            outcomes.setdefault(name, []).append(outcome)
            problems += outcome.problems(events)
            say(
                f"  round {round_ + 1}: {name:<17} {outcome.rate:>9,.0f} ev/s"
                f" ({outcome.handled} in {outcome.seconds:.2f} s)"
            )
    rates = {n: [o.rate for o in got] for n, got in outcomes.items()}
    return summarize(workloads, rates), outcomes, problems


# -- statements per event ---------------------------------------------------------------------


def count_statements(url: str, events: int) -> dict[str, dict[str, float]]:
    """Statements and round trips (syncs) per event, from libpq's protocol trace, of the PG
    per-event and per-batch drains, outboxkit's and the references', in this process."""
    found: dict[str, dict[str, float]] = {}
    for name in (
        "ref-tx-1",
        "kit-tx-1",
        "bare-tx-1",
        "ref-nontx-1",
        "kit-nontx-1",
        "ref-batch-1",
        "kit-batch-1",
        "bare-batch-1",
        "ref-w-tx-1",
        "kit-w-tx-1",
        "bare-w-tx-1",
        "ref-w-batch-sp",
        "ref-w-batch",
        "kit-w-batch-1",
        "bare-w-batch-1",
    ):
        contender = CONTENDERS[name]
        with pg_schema(url, "outboxkit_compare") as schema:
            prepare_pg(url, contender, schema, events)
            with tempfile.TemporaryFile("w+") as trace, _traced_connections(trace.fileno()):
                pg_worker(contender)(Job(contender, url, schema), _NoBarrier())  # type: ignore[arg-type]
                trace.flush()
                trace.seek(0)
                text = trace.read()
                if os.environ.get("COMPARE_TRACE_DIR"):
                    Path(os.environ["COMPARE_TRACE_DIR"], f"{name}.trace").write_text(text)
                counts = _trace_counts(text)
        found[name] = {k: v / events for k, v in counts.items()}
    return found


@contextlib.contextmanager
def _traced_connections(fileno: int) -> Iterator[None]:
    """Every psycopg connection opened inside writes libpq's protocol trace to ``fileno``."""
    import psycopg

    original = psycopg.Connection.connect.__func__  # type: ignore[attr-defined]

    def traced(cls: Any, *args: Any, **kwargs: Any) -> Any:
        conn = original(cls, *args, **kwargs)
        conn.pgconn.trace(fileno)
        conn.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
        return conn

    saved = psycopg.connect
    psycopg.Connection.connect = classmethod(traced)  # type: ignore[method-assign,assignment]
    psycopg.connect = psycopg.Connection.connect
    try:
        yield
    finally:
        psycopg.Connection.connect = classmethod(original)  # type: ignore[method-assign,assignment]
        psycopg.connect = saved


class _NoBarrier:
    def wait(self) -> None:
        pass


def _trace_counts(text: str) -> dict[str, int]:
    """Frontend messages in a libpq trace: statements (Query, Execute) and syncs."""
    counts = {"statements": 0, "round trips": 0}
    for line in text.splitlines():
        parts = line.split("\t") if "\t" in line else line.split()
        if len(parts) < 3 or parts[0] != "F":
            continue
        message = parts[2]
        if message in ("Query", "Execute"):
            counts["statements"] += 1
        if message in ("Query", "Sync"):
            counts["round trips"] += 1
    return counts


# -- main -------------------------------------------------------------------------------------


def command_line(args: argparse.Namespace) -> str:
    """The command that gives ``args``' figures, as the README shows it (``--json`` and
    ``--update-readme`` left out: they change where the figures go, not what they are)."""
    words = ["python bench/compare.py"]
    if args.bare:
        words.append("--bare")
    if args.events != 10_000:
        words.append(f"--events {args.events}")
    if args.rounds != 3:
        words.append(f"--rounds {args.rounds}")
    words.extend(f"--only {name}" for name in args.only)
    return " ".join(words)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--only", action="append", choices=WORKLOAD_NAMES, default=[], help="repeatable"
    )
    parser.add_argument("--pg-url", default=pg_url_default())
    parser.add_argument("--json", action="store_true", help="print one JSON document instead")
    parser.add_argument("--update-readme", action="store_true", help=f"rewrite {README.name}")
    parser.add_argument(
        "--bare",
        action="store_true",
        help="add outboxkit's own statements replayed by a plain loop (no poller), PG and SQLite,"
        " with a no-op handler and with one that writes a row",
    )
    parser.add_argument(
        "--statements", action="store_true", help="only count statements per event (PG)"
    )
    parser.add_argument(
        "--ref-handler-us",
        type=float,
        default=0.0,
        metavar="N",
        help="not a reference: the minimal loops' handler spends N microseconds of CPU per event"
        " (what a poller's own per-event work costs in a ratio)",
    )
    parser.add_argument(
        "--ref-claim-probe",
        action="store_true",
        help="not a reference: the PostgreSQL minimal loops claim by primary key (id = ANY of"
        " the picked ids), as outboxkit's claim does, instead of joining the CTE",
    )
    args = parser.parse_args(argv)
    if args.events < 1 or args.rounds < 1:
        parser.error("--events and --rounds must be at least 1")
    if args.ref_handler_us < 0:
        parser.error(f"--ref-handler-us must be at least 0, got {args.ref_handler_us}")
    if (args.ref_handler_us or args.ref_claim_probe) and args.update_readme:
        parser.error(
            "--ref-handler-us and --ref-claim-probe change the references: not for --update-readme"
        )
    os.environ[REF_HANDLER_ENV] = str(args.ref_handler_us)  # for the spawned workers
    os.environ[REF_CLAIM_PROBE_ENV] = "1" if args.ref_claim_probe else "0"

    if args.statements:
        found = count_statements(args.pg_url, args.events)
        if args.json:
            print(json.dumps(found, indent=2))
            return
        print(f"per event, {args.events} events, batch {BATCH} (libpq trace):")
        for name, counts in found.items():
            print(
                f"  {name:<12} {CONTENDERS[name].label:<44} {counts['statements']:.2f} statements,"
                f" {counts['round trips']:.2f} round trips"
            )
        return

    def say(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    where = machine(args.pg_url)
    say(f"compare: {args.events:,} events, {args.rounds} rounds, batch {BATCH}; {where}")
    rows, outcomes, problems = compare(
        args.pg_url, args.events, args.rounds, args.only, say, args.bare
    )
    table = results_table(rows)
    if args.json:
        doc = {
            "events": args.events,
            "rounds": args.rounds,
            "machine": where,
            "rows": [asdict(r) for r in rows],
            "contenders": {
                n: [asdict(o) | {"rate": o.rate} for o in got] for n, got in outcomes.items()
            },
            "problems": problems,
        }
        print(json.dumps(doc, indent=2))
    else:
        print(table)
        for row in rows:
            print(
                f"  {row.workload}: per-round ratios " + ", ".join(f"{r:.2f}" for r in row.rounds)
            )
        for problem in problems:
            print(f"WARNING: {problem}")
    if args.update_readme:
        today = datetime.date.today().isoformat()
        header = (
            f"`{command_line(args)}` on {today}: {where}; {args.events:,} events,"
            f" {args.rounds} rounds (medians; ratio = outboxkit / reference)."
        )
        update_readme(table, header)
        say(f"updated {README}")
    if problems:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
