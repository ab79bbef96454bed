"""Per-key order under faults on PostgreSQL (R15), through the ordering checker.

Two publisher processes enqueue keyed events over 200 keys (ten per transaction, keys at
random, both publishers on every key) while four poller processes deliver them to a
transactional handler that fails at random on its first two attempts; one poller at a time is
SIGKILLed (and a new one spawned) or frozen past its lease (SIGSTOP, then SIGCONT). Then a
fault-free drain, and the figures: for every key the handlers first ran in commit order (the
app's own record of it, see ``tests/faults/_ordering``), no event of a key ran before the
previous one was settled; nothing lost, no ledger row twice, nothing stuck or dead, no double
claim.

Sizes: 1,200 events, 4 kills and 2 freezes; with ``OUTBOXKIT_FAULTS_SCALE=large``, 20,000 events,
12 kills and 6 freezes.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outboxkit_pg import PostgresStore
from tests.faults._harness import drain_until_done, figures
from tests.faults._ordering import (
    OrderingFleet,
    RunLog,
    create_pg_tables,
    order_figures,
    outbox_for,
    pg_commits,
    pg_ledger,
    run_fleet,
)
from tests.faults._scale import scale
from tests.integration.pg._workers import create_app_tables

pytestmark = [pytest.mark.pg, pytest.mark.faults]

EVENTS = scale(pr=1200, large=20000)
PUBLISHERS = 2
POLLERS = 4
BATCH = 10
LEASE = 2.0
KILLS = scale(pr=4, large=12)
FREEZES = scale(pr=2, large=6)
FAULT_EVERY = scale(pr=1.0, large=6.0)  # seconds between two faults
TIMEOUT = scale(pr=240, large=900)  # bound of each phase, seconds


def test_key_order_under_sigkill_and_lease_expiry(
    pg_url: str,
    pg_schema: str,
    admin: psycopg.Connection[Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    rng = random.Random(19)
    started = time.monotonic()
    store = PostgresStore(pg_url, schema=pg_schema)
    try:
        store.migrate()
    finally:
        store.close()
    create_app_tables(admin, pg_schema)
    create_pg_tables(admin, pg_schema)
    options = {"batch_size": BATCH, "lease": LEASE, "interval": 0.2}
    watcher = PostgresStore(pg_url, schema=pg_schema)
    try:
        with OrderingFleet(pg_url, pg_schema, tmp_path, options, max_seconds=2 * TIMEOUT) as fleet:
            run = run_fleet(
                fleet,
                lambda: _settled(watcher),
                pollers=POLLERS,
                publishers=PUBLISHERS,
                events=EVENTS,
                kills=KILLS,
                freezes=FREEZES,
                every=FAULT_EVERY,
                freeze_for=LEASE + 1.0,
                timeout=TIMEOUT,
                rng=rng,
            )
    finally:
        watcher.close()
    drain_runs = RunLog(tmp_path / "runs-drain.jsonl")
    store = PostgresStore(pg_url, schema=pg_schema)
    try:
        assert drain_until_done(
            outbox_for(store, drain_runs, pg_ledger(pg_schema)), timeout=60, lease=5.0
        )
    finally:
        drain_runs.close()
        store.close()
    result = figures(admin, pg_schema, EVENTS, run.traces)
    order = order_figures(
        pg_commits(admin, pg_schema), [*run.runs, tmp_path / "runs-drain.jsonl"], run.traces
    )
    wall = time.monotonic() - started
    with capsys.disabled():
        print(
            f"\n[faults:ordering-pg] {EVENTS} events, {order.keys} keys, {PUBLISHERS} publishers,"
            f" {POLLERS} pollers, {run.kills} kills, {run.freezes} freezes, {wall:.1f}s: {order.line()}"
            f" {result.line()}"
        )
    assert [p["errors"] for p in run.published] == [[]] * PUBLISHERS, run.published
    assert sum(len(p["ids"]) for p in run.published) == EVENTS
    assert (run.kills, run.freezes) == (KILLS, FREEZES)
    assert (order.order, order.overlap, order.unrun) == (0, 0, 0)
    assert order.retries > 0  # the injected failures happened, and were retried
    assert order.expired > 0  # and leases ran out under killed or frozen pollers
    assert result.invariants() == (0, 0, 0, 0, 0)
    assert result.dup_ext == 0  # no non-transactional handler here
    assert run.exit_codes.count(0) == POLLERS
    assert set(run.exit_codes) <= {0, -9}


def _settled(store: PostgresStore) -> bool:
    stats = store.stats(now=None)
    return stats.pending + stats.claimed == 0
