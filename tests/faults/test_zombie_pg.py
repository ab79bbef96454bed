"""A zombie poller: frozen by SIGSTOP inside a handler until its lease has passed and
another poller has published its event, then resumed with SIGCONT. Its record and its settle are
fenced by the claim token, so nothing it does after waking changes the outbox: the events, their
delivery records and the ledger are exactly as before; only its one outside effect (the mail it
was sending when frozen) is repeated, the duplicate the README allows after a lost lease.

The zombie is frozen in the non-transactional handler: frozen in a transactional one, it would hold
its delivery transaction's row lock, and no other poller could take the event over until the
database ends that transaction (the ``idle_in_transaction_session_timeout`` test's subject).

Sizes: 300 events; with ``OUTBOXKIT_FAULTS_SCALE=large``, 1,500 (see ``tests/faults/_scale.py``).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outboxkit import Outbox
from outboxkit_pg import PostgresStore
from tests.faults._harness import TOPICS, drain, enqueue, figures
from tests.faults._scale import scale
from tests.integration.pg._workers import Fleet, create_app_tables, wait_until

pytestmark = [pytest.mark.pg, pytest.mark.faults]

EVENTS = scale(pr=300, large=1500)
POLLERS = 3
BATCH = 10
LEASE = 2.0


def _snapshot(admin: psycopg.Connection[Any], schema: str) -> tuple[list[Any], ...]:
    def rows(query: str, table: str) -> list[Any]:
        return admin.execute(sql.SQL(query).format(sql.Identifier(schema, table))).fetchall()

    return (
        rows(
            "SELECT id, attempts, claim_token, locked_until, published_at, failed_at, last_error"
            " FROM {} ORDER BY id",
            "outbox_events",
        ),
        rows("SELECT * FROM {} ORDER BY event_id, handler", "outbox_deliveries"),
        rows("SELECT event_id, handler FROM {} ORDER BY 1, 2", "ledger"),
    )


def test_a_zombie_poller_changes_nothing_after_waking(
    pg_url: str,
    pg_schema: str,
    admin: psycopg.Connection[Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    store = PostgresStore(pg_url, schema=pg_schema)
    try:
        store.migrate()
        create_app_tables(admin, pg_schema)
        outbox = Outbox(store)
        hold = tmp_path / "hold"
        hold.mkdir()
        options = {"batch_size": BATCH, "lease": LEASE, "interval": 0.2}
        with Fleet(pg_url, pg_schema, tmp_path, options, topics=TOPICS, hold_dir=hold) as fleet:
            for _ in range(POLLERS):
                fleet.spawn()
            assert fleet.wait_ready(60), "poller processes did not start"
            enqueue(pg_url, outbox, EVENTS // 2)
            (held,) = enqueue(pg_url, outbox, 1, start=EVENTS // 2, hold=True)
            enqueue(pg_url, outbox, EVENTS - EVENTS // 2 - 1, start=EVENTS // 2 + 1)

            assert wait_until(lambda: any(hold.glob("HOLD-*")), 60), "nobody took the held event"
            (marker,) = hold.glob("HOLD-*")
            pid = int(marker.name.split("-")[1])
            assert pid in [p.pid for p in fleet.processes]
            os.kill(pid, signal.SIGSTOP)
            try:
                (hold / "GO").touch()  # seen only once the zombie is resumed
                # Its lease runs out; the others take its batch over and finish everything.
                assert wait_until(lambda: store.stats(now=None).published == EVENTS, 90), (
                    f"not published while the zombie slept: {store.stats(now=None)}"
                )
                before = _snapshot(admin, pg_schema)
                mails_before = admin.execute(
                    sql.SQL("SELECT count(*) FROM {} WHERE event_id = %s").format(
                        sql.Identifier(pg_schema, "side_effects")
                    ),
                    (held,),
                ).fetchone()
            finally:
                os.kill(pid, signal.SIGCONT)
            # Awake: it finishes sending its mail, then finds its lease gone.
            lost_line = f"event {held} ("
            assert wait_until(
                lambda: any(
                    lost_line in line and "lease lost" in line for line in fleet.logs().splitlines()
                ),
                30,
            ), "the zombie did not report its lost lease"
            exit_codes = fleet.shutdown()
        after = _snapshot(admin, pg_schema)
        assert drain(pg_url, pg_schema, timeout=30)
        result = figures(admin, pg_schema, EVENTS, fleet.traces())
        zombie_mails = admin.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE event_id = %s AND pid = %s").format(
                sql.Identifier(pg_schema, "side_effects")
            ),
            (held, pid),
        ).fetchone()
    finally:
        store.close()
    with capsys.disabled():
        print(f"\n[faults:zombie-pg] {EVENTS} events, {POLLERS} pollers: {result.line()}")
    assert after == before  # the zombie's delivery and settle changed nothing
    assert mails_before == (1,)  # the new owner's mail
    assert zombie_mails == (1,)  # and the zombie's, sent on waking: the one allowed duplicate
    assert result.invariants() == (0, 0, 0, 0, 0)
    assert 1 <= result.dup_ext <= BATCH  # the held mail; at most one per event of its batch
    assert exit_codes == [0] * POLLERS
