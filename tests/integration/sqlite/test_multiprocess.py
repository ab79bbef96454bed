"""2 publisher + 4 poller processes on one SQLite file, 5,000 events.

Every (event, handler) is recorded exactly once, the transactional handler's ledger has exactly
one row per event, no error ("database is locked" or any other) reaches a caller in any process,
and no event is ever held by two claims at once. And two processes with the asyncio poller on
one file deliver every event once.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import sqlite3
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from outboxkit import EventBus, Outbox
from outboxkit_sqlite import SQLiteStore

from . import _workers

PUBLISHERS = 2
POLLERS = 4
EVENTS = 5000
PER_TRANSACTION = 25
BATCH_SIZE = 50
BUDGET = 150.0  # seconds: every process gives up by itself, and is killed after that


@pytest.fixture
def spawn() -> Iterator[Any]:
    """A spawn context; every process started through it is joined or killed at teardown."""
    context = multiprocessing.get_context("spawn")
    started: list[Any] = []

    def start(target: Any, *args: Any) -> Any:
        process = context.Process(target=target, args=args, daemon=True)
        process.start()
        started.append(process)
        return process

    yield start
    for process in started:
        if process.is_alive():
            process.kill()
        process.join(timeout=10)
        process.close()


def read_result(path: Path) -> dict[str, Any]:
    assert path.exists(), f"worker wrote no result: {path.name}"
    result: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return result


def test_two_publishers_four_pollers_one_file(tmp_path: Path, spawn: Any) -> None:
    path = tmp_path / "shared.db"
    with SQLiteStore(path) as store:
        url, options = store.url, dict(store.options)
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute(_workers.LEDGER_SQL)
        conn.execute(_workers.ORDERS_SQL)
    done = tmp_path / "publishers-done"
    deadline = time.time() + BUDGET
    started = time.perf_counter()

    pollers = [
        spawn(
            _workers.poll,
            url,
            options,
            str(done),
            str(tmp_path / f"effects-{n}.txt"),
            str(tmp_path / f"poller-{n}.json"),
            deadline,
            BATCH_SIZE,
        )
        for n in range(POLLERS)
    ]
    publishers = [
        spawn(
            _workers.publish,
            url,
            options,
            n + 1,
            EVENTS // PUBLISHERS,
            PER_TRANSACTION,
            str(tmp_path / f"publisher-{n}.json"),
            deadline,
        )
        for n in range(PUBLISHERS)
    ]
    for process in publishers:
        process.join(timeout=BUDGET + 10)
        assert process.exitcode == 0, f"publisher exit code {process.exitcode}"
    done.touch()
    for process in pollers:
        process.join(timeout=max(1.0, deadline + 10 - time.time()))
        assert process.exitcode == 0, f"poller exit code {process.exitcode}"
    wall = time.perf_counter() - started

    results = [read_result(tmp_path / f"publisher-{n}.json") for n in range(PUBLISHERS)]
    results += [read_result(tmp_path / f"poller-{n}.json") for n in range(POLLERS)]
    # Nothing reached a caller: no exception in any process, no warning logged by outboxkit.
    for result in results:
        assert result["errors"] == [], result["errors"]
        assert result["warnings"] == [], result["warnings"]

    published_ids = sorted(i for r in results if r["role"] == "publisher" for i in r["ids"])
    assert len(published_ids) == EVENTS == len(set(published_ids))

    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        events = dict(conn.execute("SELECT id, published_at IS NOT NULL FROM outbox_events"))
        records = conn.execute("SELECT event_id, handler FROM outbox_deliveries").fetchall()
        ledger = conn.execute("SELECT event_id, handler FROM ledger").fetchall()
        (orders,) = conn.execute("SELECT count(*) FROM orders").fetchone()
    assert sorted(events) == published_ids
    assert all(events.values()), "every event is published"
    assert orders == EVENTS // PER_TRANSACTION

    # Every (event, handler) recorded exactly once.
    assert Counter(records) == {(i, h): 1 for i in published_ids for h in ("ledger", "notify")}
    # The transactional handler's row: exactly one per (event, handler).
    assert Counter(ledger) == {(i, "ledger"): 1 for i in published_ids}
    # The outside effect: at least once; with no crash and no lost lease, exactly once.
    effects = Counter(
        int(line)
        for n in range(POLLERS)
        for line in (tmp_path / f"effects-{n}.txt").read_text().split()
    )
    assert effects == dict.fromkeys(published_ids, 1)

    # No event held by two claims at once (windows lie inside the real leases).
    windows: dict[int, list[tuple[float, float]]] = defaultdict(list)
    per_poller = []
    for result in results:
        if result["role"] != "poller":
            continue
        per_poller.append(len(result["claims"]))
        for claim in result["claims"]:
            assert claim["until"] is not None and claim["settled"], claim
            windows[claim["event"]].append((claim["from"], claim["until"]))
    assert sorted(windows) == published_ids
    for event_id, spans in windows.items():
        spans.sort()
        for (_, first_end), (second_start, _) in itertools.pairwise(spans):
            assert first_end <= second_start, f"event {event_id} claimed twice at once: {spans}"

    rate = EVENTS / wall
    print(
        f"\nSQLite multi-process: {EVENTS} events, {PUBLISHERS} publishers + {POLLERS} pollers, "
        f"wall {wall:.1f}s, {rate:.0f} events/s; claims per poller {per_poller}"
    )


ASYNC_EVENTS = 300
ASYNC_BUDGET = 60.0


def test_two_asyncio_pollers_one_file_deliver_every_event_once(tmp_path: Path, spawn: Any) -> None:
    # Two processes, each with the asyncio poller (concurrency 1 and 4), drain one file: every
    # (event, handler) is recorded once, the async handler's row written once.
    path = tmp_path / "shared.db"
    with SQLiteStore(path) as store:
        url, options = store.url, dict(store.options)
        with store.transaction() as conn:
            conn.execute(_workers.LEDGER_SQL)
            outbox = Outbox(store, EventBus(), load_entry_points=False)
            ids = outbox.enqueue_many(
                conn, [(_workers.TOPIC, {"n": n}) for n in range(ASYNC_EVENTS)]
            )
    deadline = time.time() + ASYNC_BUDGET
    pollers = [
        spawn(
            _workers.async_poll,
            url,
            options,
            str(tmp_path / f"effects-{n}.txt"),
            str(tmp_path / f"poller-{n}.json"),
            deadline,
            25,
            concurrency,
        )
        for n, concurrency in enumerate((1, 4))
    ]
    for process in pollers:
        process.join(timeout=ASYNC_BUDGET + 10)
        assert process.exitcode == 0, f"poller exit code {process.exitcode}"
    results = [read_result(tmp_path / f"poller-{n}.json") for n in range(2)]
    for result in results:
        assert result["errors"] == [], result["errors"]
        assert result["warnings"] == [], result["warnings"]
    assert sum(r["published"] for r in results) == ASYNC_EVENTS

    with closing(sqlite3.connect(path)) as conn:
        published = dict(conn.execute("SELECT id, published_at IS NOT NULL FROM outbox_events"))
        records = conn.execute("SELECT event_id, handler FROM outbox_deliveries").fetchall()
        ledger = conn.execute("SELECT event_id, handler FROM ledger").fetchall()
    assert published == dict.fromkeys(ids, 1)
    assert Counter(records) == {(i, h): 1 for i in ids for h in ("ledger", "notify")}
    assert Counter(ledger) == {(i, "ledger"): 1 for i in ids}
    effects = Counter(
        int(line) for n in range(2) for line in (tmp_path / f"effects-{n}.txt").read_text().split()
    )
    assert effects == dict.fromkeys(ids, 1)
