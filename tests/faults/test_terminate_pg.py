"""``pg_terminate_backend`` storms on PostgreSQL, through the shared fault harness.

Three pollers drain 900 events over three topics, arriving in chunks; once a second, five times,
an admin connection terminates every backend of the pollers: their pooled connections (a
delivery or a claim in flight included) and their ``LISTEN`` connections. Only this test's
backends are touched: the pollers connect with an ``application_name`` made for this test, and
the storm matches it in this database, never the admin's own session. The mailer's "outside
world" connection is not a poller connection and is left alone.

A lost connection is a ``StoreUnavailable``: ``run_forever`` logs the outage, waits it out and
goes on. So every poller is still alive after the storms and exits 0 when asked to stop; then a
fault-free drain and the figures: nothing lost, no ledger row twice, nothing stuck or dead, no
double claim. The mailer's duplicates come only from an event whose mail was sent when its
delivery record's transaction was cut: at most one per poller per storm.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outboxkit import Outbox
from outboxkit_pg import PostgresStore
from tests.faults._harness import TOPICS, drain, enqueue, figures, with_application_name
from tests.faults._scale import scale
from tests.integration.pg._workers import Fleet, create_app_tables

pytestmark = [pytest.mark.pg, pytest.mark.faults]

EVENTS = scale(pr=900, large=4500)
CHUNK = 100
POLLERS = 3
BATCH = 10
STORMS = scale(pr=5, large=10)
STORM_EVERY = 1.0

TERMINATE = (
    "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity"
    " WHERE application_name = %s AND datname = current_database()"
    " AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
)


def test_pg_terminate_backend_storms(
    pg_url: str,
    pg_schema: str,
    admin: psycopg.Connection[Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    app_name = f"okt_terminate_{uuid.uuid4().hex[:8]}"
    poller_url = with_application_name(pg_url, app_name)
    store = PostgresStore(pg_url, schema=pg_schema)
    try:
        store.migrate()
        create_app_tables(admin, pg_schema)
        outbox = Outbox(store)
        options = {"batch_size": BATCH, "lease": 2.0, "interval": 0.2}
        with Fleet(
            poller_url, pg_schema, tmp_path, options, side_url=pg_url, topics=TOPICS
        ) as fleet:
            for _ in range(POLLERS):
                fleet.spawn()
            assert fleet.wait_ready(60), "poller processes did not start"
            started = time.monotonic()
            storm_at = [started + STORM_EVERY * (k + 1) for k in range(STORMS)]
            chunk_at = started
            sent = 0
            terminated: list[int] = []
            pause = threading.Event()
            while storm_at or sent < EVENTS:
                now = time.monotonic()
                if sent < EVENTS and now >= chunk_at:
                    enqueue(pg_url, outbox, min(CHUNK, EVENTS - sent), start=sent)
                    sent += CHUNK
                    chunk_at += STORM_EVERY * STORMS / (EVENTS / CHUNK)
                if storm_at and now >= storm_at[0]:
                    storm_at.pop(0)
                    rows = admin.execute(TERMINATE, (app_name,)).fetchall()
                    terminated.append(sum(1 for _, done in rows if done))
                pause.wait(0.01)
            alive_after_storms = len(fleet.live())
            exit_codes = fleet.shutdown()
            logs = fleet.logs()
        assert drain(pg_url, pg_schema, timeout=60)
        result = figures(admin, pg_schema, EVENTS, fleet.traces())
    finally:
        store.close()
    outages = logs.count("store unavailable, retrying with backoff")
    with capsys.disabled():
        print(
            f"\n[faults:terminate-pg] {EVENTS} events, {POLLERS} pollers, {STORMS} storms "
            f"terminating {terminated} backends ({outages} outages logged): {result.line()}"
        )
    assert len(terminated) == STORMS
    assert sum(terminated) >= STORMS  # the storms hit the pollers' backends
    assert alive_after_storms == POLLERS  # no poller died of a terminated connection
    assert exit_codes == [0] * POLLERS  # and each stopped cleanly when asked
    assert result.invariants() == (0, 0, 0, 0, 0)
    assert result.dup_ext <= STORMS * POLLERS
