"""Acceptance 3: SIGKILL a random poller every 2 s for 20 s while 3,000 events drain.

Four pollers; every two seconds one of them, chosen at random, is killed with SIGKILL and a new
one spawned in its place, while the events arrive in chunks. Afterwards nothing is lost, no
ledger row is duplicated, nothing is stuck; the non-transactional handler's duplicated side
effects (expected after a kill) are counted and bounded by kills x batch size.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import psycopg
import pytest

from outboxkit import Message, Outbox
from outboxkit_pg import PostgresStore

from ._workers import (
    TOPIC,
    Fleet,
    count,
    create_app_tables,
    lease_overlaps,
    read_traces,
    wait_until,
)
from .conftest import fresh_schema

pytestmark = [pytest.mark.pg, pytest.mark.slow]

EVENTS = 3_000
POLLERS = 4
BATCH = 20
CHAOS_SECONDS = 20.0
KILL_EVERY = 2.0
KILLS = int(CHAOS_SECONDS / KILL_EVERY)
BACKLOG = 600


def test_sigkill_a_poller_every_two_seconds(
    pg_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = random.Random(5)
    with fresh_schema(pg_url) as schema, psycopg.connect(pg_url, autocommit=True) as admin:
        store = PostgresStore(pg_url, schema=schema)
        try:
            store.migrate()
            create_app_tables(admin, schema)
            outbox = Outbox(store)
            # A short lease, so that a killed poller's batch is taken over quickly.
            options = {"batch_size": BATCH, "lease": 2.0, "interval": 0.2}
            with Fleet(pg_url, schema, tmp_path, options) as fleet:
                for _ in range(POLLERS):
                    fleet.spawn()
                assert fleet.wait_ready(60), "poller processes did not start"
                started = time.monotonic()
                # A backlog, then a steady stream, so that the pollers are busy when killed.
                backlog, rest = range(BACKLOG), range(BACKLOG, EVENTS)
                chunks = [backlog] + [rest[i : i + 40] for i in range(0, len(rest), 40)]
                kill_at = [started + KILL_EVERY * (k + 1) for k in range(KILLS)]
                chunk_at = started
                pause = threading.Event()
                while kill_at or chunks:
                    now = time.monotonic()
                    if chunks and now >= chunk_at:
                        with psycopg.connect(pg_url) as app, app.transaction():
                            outbox.enqueue_many(
                                app, [Message(TOPIC, {"n": n}) for n in chunks.pop(0)]
                            )
                        chunk_at += 0.25
                    if kill_at and now >= kill_at[0]:
                        kill_at.pop(0)
                        fleet.kill(rng.choice(fleet.live()))
                        fleet.spawn()
                    pause.wait(0.02)
                assert not chunks
                drained = wait_until(lambda: store.stats(now=None).published == EVENTS, 90)
                wall = time.monotonic() - started
                exit_codes = fleet.shutdown()
                kills = fleet.kills
            stats = store.stats(now=None)
        finally:
            store.close()

        lost = EVENTS - stats.published
        stuck = stats.pending + stats.claimed
        ledger_dups = count(
            admin,
            "SELECT coalesce(sum(n - 1), 0) FROM (SELECT count(*) AS n FROM {}"
            " GROUP BY event_id, handler) AS l",
            schema,
            "ledger",
        )
        ledger_missing = count(
            admin,
            "SELECT count(*) FROM {} AS e WHERE NOT EXISTS (SELECT 1 FROM {} AS l"
            " WHERE l.event_id = e.id)",
            schema,
            "outbox_events",
            "ledger",
        )
        side_effects = count(admin, "SELECT count(*) FROM {}", schema, "side_effects")
        side_distinct = count(
            admin, "SELECT count(DISTINCT event_id) FROM {}", schema, "side_effects"
        )
        attempts = count(admin, "SELECT sum(attempts) FROM {}", schema, "outbox_events")
        windows = read_traces(fleet.traces())
        overlaps = lease_overlaps(windows)
        with capsys.disabled():
            print(
                f"\n[chaos] {EVENTS} events, {POLLERS} pollers, batch {BATCH}: {kills} kills in "
                f"{CHAOS_SECONDS:.0f} s; drained after {wall:.1f} s; lost {lost}, duplicate "
                f"ledger rows {ledger_dups}, stuck {stuck}, dead {stats.dead}; non-transactional "
                f"side effects {side_effects} for {side_distinct} events (duplicates "
                f"{side_effects - side_distinct}, bound {kills * BATCH}); attempts {attempts}; "
                f"lease overlaps {len(overlaps)} in {len(windows)} claims"
            )
        assert drained, f"not drained: {stats}"
        assert kills == KILLS
        assert (lost, ledger_dups, ledger_missing, stuck, stats.dead) == (0, 0, 0, 0, 0)
        assert side_distinct == EVENTS
        assert side_effects - side_distinct <= kills * BATCH
        assert overlaps == []
        # The survivors (and the last respawns) stopped cleanly; the killed ones by SIGKILL.
        assert sorted(set(exit_codes)) in ([-9, 0], [0])
        assert exit_codes.count(0) == POLLERS
