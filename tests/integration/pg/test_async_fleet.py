"""The asyncio poller in several processes: two processes, each an asyncio poller delivering
eight events at once, drain 5,000 events (the fault tier's PR size) on PostgreSQL.

Every (event, handler) is recorded exactly once, the transactional handler's ledger (an
``async def`` handler writing through the delivery's ``AsyncConnection``) holds exactly one row
per event, and no event is ever held by two live leases at once: each process traces its
claims (token and lease window, in the database clock), extensions, settlements and releases
(``_workers._Trace.wrap_async``), and the windows are compared. Ends with a figures line
``[faults:async-pg]`` (see ``tests/faults/README.md``).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import psycopg
import pytest

from outboxkit import Message, Outbox
from outboxkit_pg import PostgresStore
from tests.faults._scale import scale

from ._workers import (
    HANDLERS,
    TOPIC,
    Fleet,
    Tally,
    create_app_tables,
    lease_overlaps,
    read_traces,
    wait_until,
)
from .conftest import fresh_schema

pytestmark = [pytest.mark.pg, pytest.mark.faults]

EVENTS = scale(pr=5_000, large=20_000)
PROCESSES = 2
CONCURRENCY = 8
BATCH = 100


async def enqueue_async(url: str, outbox: Outbox, events: int) -> None:
    """The events in one app transaction of an ``AsyncConnection``, 1,000 per statement."""
    async with await psycopg.AsyncConnection.connect(url) as conn:
        for first in range(0, events, 1000):
            last = min(first + 1000, events)
            await outbox.enqueue_many_async(
                conn, [Message(TOPIC, {"n": n}) for n in range(first, last)]
            )


def test_two_asyncio_pollers_with_concurrency_8_drain_every_event_once(
    pg_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with fresh_schema(pg_url) as schema, psycopg.connect(pg_url, autocommit=True) as admin:
        store = PostgresStore(pg_url, schema=schema)
        try:
            store.migrate()
            create_app_tables(admin, schema)
            outbox = Outbox(store)
            options = {
                "batch_size": BATCH,
                "lease": 30.0,
                "interval": 0.5,
                "concurrency": CONCURRENCY,
            }
            # Each delivery holds a connection, and a lease extension takes one more.
            store_options = {"pool_max_size": CONCURRENCY + 1}
            with Fleet(
                pg_url,
                schema,
                tmp_path,
                options,
                asyncio_poller=True,
                store_options=store_options,
            ) as fleet:
                for _ in range(PROCESSES):
                    fleet.spawn()
                assert fleet.wait_ready(60), "poller processes did not start:\n" + fleet.logs()
                started = time.monotonic()
                asyncio.run(enqueue_async(pg_url, outbox, EVENTS))
                drained = wait_until(lambda: store.stats(now=None).published == EVENTS, 240)
                wall = time.monotonic() - started
                alive = len(fleet.live())
                exit_codes = fleet.shutdown()
                logs = fleet.logs()
            stats = store.stats(now=None)
        finally:
            store.close()

        assert drained, f"not drained: {stats}\n{logs}"
        assert alive == PROCESSES
        assert exit_codes == [0] * PROCESSES, logs
        assert (stats.published, stats.pending, stats.claimed, stats.dead) == (EVENTS, 0, 0, 0)
        tally = Tally.of(admin, schema)
        # No event was held by two live leases at once; no claim took more than its batch.
        windows = read_traces(fleet.traces())
        overlaps = lease_overlaps(windows)
        claims = [
            json.loads(line)
            for path in fleet.traces()
            for line in path.read_text("utf-8").splitlines()
            if '"kind": "claim"' in line
        ]
        overclaim = sum(1 for claim in claims if claim["batch"] > claim["limit"])
        processes = len({w.pid for w in windows})
        with capsys.disabled():
            print(
                f"\n[faults:async-pg] {EVENTS} events, {PROCESSES} processes x concurrency "
                f"{CONCURRENCY}: {wall:.2f} s, {EVENTS / wall:.0f} events/s, "
                f"lost={tally.lost} dup_tx={tally.ledger - tally.distinct} "
                f"records={tally.records} incomplete={tally.incomplete} "
                f"overlaps={len(overlaps)} overclaim={overclaim} claims={len(windows)} "
                f"claiming_processes={processes} side_effects={tally.side_effects} "
                f"(duplicates {tally.side_effects - EVENTS})"
            )
        # Every (event, handler) recorded exactly once, as succeeded; the transactional
        # handler's writes: exactly one ledger row per event.
        assert tally.lost == 0
        assert tally.records == EVENTS * len(HANDLERS)
        assert tally.incomplete == 0
        assert (tally.ledger, tally.distinct) == (EVENTS, EVENTS)
        assert len({w.event for w in windows}) == EVENTS
        assert overlaps == []
        assert overclaim == 0
        assert processes == PROCESSES  # both processes claimed: they competed for the events
        assert tally.side_effects == EVENTS  # no fault here: the outside world saw each event once
