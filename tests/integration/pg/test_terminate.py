"""Acceptance 4: ``pg_terminate_backend`` on the pollers' connections every second for 10 s.

The pollers' sessions (their pools and LISTEN connections) carry an ``application_name`` of
their own; once a second every one of them is terminated while events keep arriving. No poller
exits, nothing is lost, and no rejection is recorded: a database failure is never blamed on a
handler.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import psycopg
import pytest

from outboxkit import Message, Outbox
from outboxkit_pg import PostgresStore

from ._workers import TOPIC, Fleet, count, create_app_tables, wait_until
from .conftest import fresh_schema

pytestmark = [pytest.mark.pg, pytest.mark.slow]

EVENTS = 2_000
POLLERS = 4
STORM_SECONDS = 10.0


def with_application_name(url: str, name: str) -> str:
    return url + ("&" if "?" in url else "?") + f"application_name={name}"


def test_terminating_the_pollers_connections_every_second(
    pg_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    app_name = f"okt_storm_{uuid.uuid4().hex[:8]}"
    poller_url = with_application_name(pg_url, app_name)
    with fresh_schema(pg_url) as schema, psycopg.connect(pg_url, autocommit=True) as admin:
        store = PostgresStore(pg_url, schema=schema)
        try:
            store.migrate()
            create_app_tables(admin, schema)
            outbox = Outbox(store)
            options = {"batch_size": 50, "lease": 5.0, "interval": 0.2}
            # The mailer's "outside world" connection is not a poller connection: left alone.
            with Fleet(poller_url, schema, tmp_path, options, side_url=pg_url) as fleet:
                for _ in range(POLLERS):
                    fleet.spawn()
                assert fleet.wait_ready(60), "poller processes did not start"
                started = time.monotonic()
                pause = threading.Event()
                terminated: list[int] = []
                chunks = [range(i, min(i + 200, EVENTS)) for i in range(0, EVENTS, 200)]
                next_round = started
                while time.monotonic() < started + STORM_SECONDS:
                    if time.monotonic() >= next_round:
                        next_round += 1.0
                        if chunks:
                            with psycopg.connect(pg_url) as app, app.transaction():
                                outbox.enqueue_many(
                                    app, [Message(TOPIC, {"n": n}) for n in chunks.pop(0)]
                                )
                        rows = admin.execute(
                            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                            " WHERE application_name = %s AND pid <> pg_backend_pid()",
                            (app_name,),
                        ).fetchall()
                        terminated.append(sum(1 for (done,) in rows if done))
                    pause.wait(0.05)
                alive_after_storm = len(fleet.live())
                for chunk in chunks:  # none left, unless the machine is very slow
                    with psycopg.connect(pg_url) as app, app.transaction():
                        outbox.enqueue_many(app, [Message(TOPIC, {"n": n}) for n in chunk])
                drained = wait_until(lambda: store.stats(now=None).published == EVENTS, 90)
                wall = time.monotonic() - started
                alive_at_end = len(fleet.live())
                exit_codes = fleet.shutdown()
                logs = fleet.logs()
            stats = store.stats(now=None)
        finally:
            store.close()

        rejected = count(
            admin, "SELECT count(*) FROM {} WHERE outcome = 'rejected'", schema, "outbox_deliveries"
        )
        records = count(admin, "SELECT count(*) FROM {}", schema, "outbox_deliveries")
        ledger_dups = count(
            admin,
            "SELECT coalesce(sum(n - 1), 0) FROM (SELECT count(*) AS n FROM {}"
            " GROUP BY event_id, handler) AS l",
            schema,
            "ledger",
        )
        attempts = count(admin, "SELECT sum(attempts) FROM {}", schema, "outbox_events")
        outages = logs.count("store unavailable, retrying with backoff")
        failed = logs.count("failed on attempt")
        with capsys.disabled():
            print(
                f"\n[terminate] {len(terminated)} rounds, {sum(terminated)} poller connections "
                f"terminated ({terminated}); pollers alive after the storm "
                f"{alive_after_storm}/{POLLERS}; {EVENTS} events drained in {wall:.1f} s; "
                f"published {stats.published}, dead {stats.dead}, rejected records {rejected}; "
                f"outages logged {outages}, handler failures {failed}, attempts {attempts} "
                f"(extra {attempts - EVENTS})"
            )
        assert sum(terminated) > 0
        assert alive_after_storm == POLLERS and alive_at_end == POLLERS  # no poller exits
        assert exit_codes == [0] * POLLERS
        assert drained, f"not drained: {stats}"
        assert (stats.published, stats.pending, stats.claimed, stats.dead) == (EVENTS, 0, 0, 0)
        assert rejected == 0
        assert records == 2 * EVENTS
        assert ledger_dups == 0
