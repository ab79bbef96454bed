"""A poller process SIGKILLed mid-batch, again and again.

Afterwards the file passes ``PRAGMA integrity_check``, a drain completes every event, and no
handler that had committed runs again: the ledger the transactional handler writes in its
delivery transaction has exactly one row per event, and the drain ran it only for the events
that had none.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import sqlite3
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import closing
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from outboxkit import FrozenClock, Message, Outbox
from outboxkit_sqlite import SQLiteStore

from . import _workers

EVENTS = 600
KILLS = 10
BATCH_SIZE = 25


def ledger_count(path: Path) -> int:
    with closing(sqlite3.connect(path, timeout=30)) as conn:
        (count,) = conn.execute("SELECT count(*) FROM ledger").fetchone()
    return int(count)


def wait_for(condition: Any, *, timeout: float, what: str) -> None:
    """Poll ``condition`` until it holds (process orchestration, not outbox timing)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


@pytest.fixture
def processes() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for process in started:
        if process.is_alive():
            process.kill()
        process.join(timeout=10)
        process.close()


def test_sigkill_mid_batch_repeatedly(tmp_path: Path, processes: list[Any]) -> None:
    path = tmp_path / "crash.db"
    clock = FrozenClock()  # the drain's clock: an hour after the killed pollers' leases
    with SQLiteStore(path) as store:
        url, options = store.url, dict(store.options)
        with store.transaction() as conn:
            conn.execute(_workers.LEDGER_SQL)
            Outbox(store).enqueue_many(
                conn, [Message(_workers.TOPIC, {"n": n}) for n in range(EVENTS)]
            )
    context = multiprocessing.get_context("spawn")
    rng = random.Random(4)
    kills = 0
    for round_ in range(KILLS):
        before = ledger_count(path)
        if before >= EVENTS - BATCH_SIZE:
            break
        process = context.Process(
            target=_workers.poll_until_killed,
            args=(url, options, str(tmp_path / f"effects-{round_}.txt"), BATCH_SIZE),
            daemon=True,
        )
        process.start()
        processes.append(process)
        # Kill it somewhere inside a batch: after 1..BATCH_SIZE-1 more ledger rows committed.
        target = before + rng.randint(1, BATCH_SIZE - 1)
        wait_for(
            lambda target=target: ledger_count(path) >= target,
            timeout=60,
            what="deliveries to start",
        )
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        process.join(timeout=10)
        assert process.exitcode == -signal.SIGKILL
        kills += 1
    assert kills == KILLS

    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        before_drain = Counter(row[0] for row in conn.execute("SELECT event_id FROM ledger"))
        claimed = conn.execute("SELECT count(*) FROM outbox_events WHERE attempts > 0").fetchone()
    assert max(before_drain.values()) == 1
    assert claimed[0] > len(before_drain)  # some batches died with events not yet delivered

    # The drain: one process, the same handlers, its clock past every dead poller's lease.
    clock.set(clock.now() + timedelta(days=1))
    with SQLiteStore(path) as store:
        bus, effects = _workers.make_bus(str(tmp_path / "effects-drain.txt"))
        try:
            poller = Outbox(store, bus, clock=clock, load_entry_points=False).poller(batch_size=100)
            for _ in range(EVENTS):
                report = poller.run_once()
                assert report.failed == [] and report.lease_lost == []
                if not report.claimed:
                    break
            stats = store.stats(now=clock.now())
        finally:
            effects.close()
    assert (stats.published, stats.pending, stats.claimed, stats.dead) == (EVENTS, 0, 0, 0)

    with closing(sqlite3.connect(path)) as conn:
        ledger = conn.execute("SELECT event_id, pid FROM ledger").fetchall()
        records = Counter(conn.execute("SELECT event_id, handler FROM outbox_deliveries"))
        ids = [row[0] for row in conn.execute("SELECT id FROM outbox_events")]
    # Exactly one ledger row per event: a handler that had committed was not run again.
    assert Counter(event_id for event_id, _ in ledger) == dict.fromkeys(ids, 1)
    ran_in_drain = {event_id for event_id, pid in ledger if pid == os.getpid()}
    assert ran_in_drain == set(ids) - set(before_drain)
    assert records == {(i, h): 1 for i in ids for h in ("ledger", "notify")}
    print(
        f"\nSQLite crash test: {kills} SIGKILLs, {len(before_drain)} ledger rows before the "
        f"drain, {len(ran_in_drain)} delivered by the drain"
    )
