"""The host clock stepped back mid-batch makes no duplicate, two processes.

Poller A claims a batch whose handlers take longer, together, than one lease; on its first
handler its host's wall clock is stepped back an hour (``SystemClock.now``, the one place
outboxkit reads the wall clock). Poller B, in another process on an unstepped clock, polls all
along. A poller that kept its lease deadlines on the wall clock believed it had an hour left,
never extended, and kept starting handlers after the database had let its leases go to B: the
red team saw 8 of 10 outside effects run twice. On the monotonic clock A extends in time, B
claims nothing of A's batch, and every effect runs once.

Real processes and real time: each handler stands for a 0.3 s call to the outside world.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outboxkit import Event, EventBus, Outbox, open_store
from outboxkit.clock import SystemClock
from tests.integration.pg._workers import wait_until

pytestmark = [pytest.mark.pg, pytest.mark.faults]

EVENTS = 12
LEASE = 2.0
WORK = 0.3  # seconds per handler: EVENTS * WORK is almost twice the lease


def _poller(url: str, schema: str, stepped: bool, folder: str, max_seconds: float) -> None:
    """A poller process: ``run_once`` until ``STOP`` appears in ``folder``."""
    real_now = SystemClock.now
    here = Path(folder)
    outside = psycopg.connect(url, autocommit=True)
    effects = sql.SQL("INSERT INTO {} (event_id, pid) VALUES (%s, %s)").format(
        sql.Identifier(schema, "side_effects")
    )
    bus = EventBus()

    @bus.handler("call", name="call-out", transactional=False)
    def call_out(event: Event, ctx: Any) -> None:
        if stepped and SystemClock.now is real_now:
            # NTP, a resumed VM, an operator's date -s: the wall clock jumps back an hour.
            SystemClock.now = lambda self: real_now(self) - timedelta(hours=1)  # type: ignore[method-assign]
            (here / "STEPPED").touch()
        time.sleep(WORK)  # the call to the outside world
        outside.execute(effects, (event.id, os.getpid()))

    store = open_store(url, schema=schema)
    outbox = Outbox(store, bus, lease=LEASE, batch_size=EVENTS, load_entry_points=False)
    poller = outbox.poller()
    deadline = time.monotonic() + max_seconds
    pause = threading.Event()
    try:
        (here / f"READY-{'A' if stepped else 'B'}").touch()
        while not (here / "STOP").exists() and time.monotonic() < deadline:
            if not poller.run_once().claimed:
                pause.wait(0.05)
    finally:
        store.close()
        outside.close()


def test_a_clock_stepped_back_mid_batch_runs_no_effect_twice(
    pg_url: str,
    pg_schema: str,
    admin: psycopg.Connection[Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    store = open_store(pg_url, schema=pg_schema)
    try:
        store.migrate()
        admin.execute(
            sql.SQL("CREATE TABLE {} (event_id bigint NOT NULL, pid integer NOT NULL)").format(
                sql.Identifier(pg_schema, "side_effects")
            )
        )
        outbox = Outbox(store, load_entry_points=False)
        with store.transaction() as conn:
            ids = outbox.enqueue_many(conn, [("call", n) for n in range(EVENTS)])
        context = multiprocessing.get_context("spawn")
        a = context.Process(target=_poller, args=(pg_url, pg_schema, True, str(tmp_path), 60))
        a.start()
        assert wait_until(lambda: (tmp_path / "STEPPED").exists(), 30), "A never claimed"
        b = context.Process(target=_poller, args=(pg_url, pg_schema, False, str(tmp_path), 60))
        b.start()
        try:
            assert wait_until(lambda: store.stats(now=None).published == EVENTS, 60), store.stats(
                now=None
            )
            assert (tmp_path / "READY-B").exists()
        finally:
            (tmp_path / "STOP").touch()
            a.join(30)
            b.join(30)
        rows = admin.execute(
            sql.SQL("SELECT event_id, pid FROM {} ORDER BY event_id").format(
                sql.Identifier(pg_schema, "side_effects")
            )
        ).fetchall()
    finally:
        store.close()
    per_event: dict[int, int] = {}
    for event_id, _ in rows:
        per_event[event_id] = per_event.get(event_id, 0) + 1
    duplicates = sum(n - 1 for n in per_event.values())
    by_b = sum(1 for _, pid in rows if pid == b.pid)
    with capsys.disabled():
        print(
            f"\n[faults:clock-step-pg] {EVENTS} events of {WORK}s, lease {LEASE}s, wall clock "
            f"stepped back 1h mid-batch: effects={len(rows)} duplicates={duplicates} "
            f"taken over by the other poller={by_b}"
        )
    assert sorted(per_event) == ids
    assert duplicates == 0
    assert by_b == 0  # A kept its leases: B never got an event of A's batch
    assert (a.exitcode, b.exitcode) == (0, 0)
