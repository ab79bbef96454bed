"""Acceptance 2: four poller processes drain 10,000 events, two handlers each.

Every (event, handler) is recorded exactly once, the transactional handler's ledger holds
exactly one row per (event, handler), and no event is ever held by two live leases at once
(every claim's token and lease window, in the database clock, is logged and compared).
"""

from __future__ import annotations

import time
from pathlib import Path

import psycopg
import pytest

from outboxkit import Message, Outbox
from outboxkit_pg import PostgresStore

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

pytestmark = [pytest.mark.pg, pytest.mark.slow]

EVENTS = 10_000
POLLERS = 4


def test_four_pollers_drain_ten_thousand_events(
    pg_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with fresh_schema(pg_url) as schema, psycopg.connect(pg_url, autocommit=True) as admin:
        store = PostgresStore(pg_url, schema=schema)
        try:
            store.migrate()
            create_app_tables(admin, schema)
            outbox = Outbox(store)
            options = {"batch_size": 100, "lease": 30.0, "interval": 0.5}
            with Fleet(pg_url, schema, tmp_path, options) as fleet:
                for _ in range(POLLERS):
                    fleet.spawn()
                assert fleet.wait_ready(60), "poller processes did not start"
                started = time.monotonic()
                with psycopg.connect(pg_url) as app, app.transaction():
                    for first in range(0, EVENTS, 1000):
                        outbox.enqueue_many(
                            app, [Message(TOPIC, {"n": n}) for n in range(first, first + 1000)]
                        )
                drained = wait_until(lambda: store.stats(now=None).published == EVENTS, 150)
                wall = time.monotonic() - started
                alive = len(fleet.live())
                exit_codes = fleet.shutdown()
            stats = store.stats(now=None)
        finally:
            store.close()

        assert drained, f"not drained: {stats}"
        assert alive == POLLERS
        assert exit_codes == [0] * POLLERS
        assert (stats.published, stats.pending, stats.claimed, stats.dead) == (EVENTS, 0, 0, 0)
        tally = Tally.of(admin, schema)
        # Every (event, handler) recorded exactly once, as succeeded.
        assert tally.records == EVENTS * len(HANDLERS)
        assert tally.incomplete == 0
        # The transactional handler's writes: exactly one ledger row per (event, handler).
        assert (tally.ledger, tally.distinct) == (EVENTS, EVENTS)
        side_effects = tally.side_effects
        # No event was held by two live leases at once.
        windows = read_traces(fleet.traces())
        assert len({w.event for w in windows}) == EVENTS
        overlaps = lease_overlaps(windows)
        assert overlaps == []
        with capsys.disabled():
            print(
                f"\n[load] {POLLERS} pollers, {EVENTS} events x {len(HANDLERS)} handlers: "
                f"{wall:.2f} s wall, {EVENTS / wall:.0f} events/s, {len(windows)} claims, "
                f"{len({w.pid for w in windows})} claiming processes, lease overlaps "
                f"{len(overlaps)}, side effects {side_effects} "
                f"(duplicates {side_effects - EVENTS})"
            )
