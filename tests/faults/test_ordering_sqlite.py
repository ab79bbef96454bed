"""Per-key order under faults on one SQLite file (R15), through the ordering checker.

``test_ordering_pg.py`` on SQLite: two publisher processes over 200 keys, four poller
processes, a transactional handler failing at random on its first two attempts, pollers
SIGKILLed (and respawned) or frozen past their lease. Then ``PRAGMA integrity_check``, a
fault-free drain and the same figures: handlers first ran in commit order for every key, none
began before the previous event of its key was settled; nothing lost, no ledger row twice,
nothing stuck or dead, no double claim.

Sizes: 1,200 events, 4 kills and 2 freezes; with ``OUTBOXKIT_FAULTS_SCALE=large``, 20,000 events,
12 kills and 6 freezes.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from outboxkit_sqlite import SQLiteStore
from tests.faults._harness import drain_until_done
from tests.faults._harness_sqlite import figures, integrity, open_outbox_file
from tests.faults._ordering import (
    OrderingFleet,
    RunLog,
    create_sqlite_tables,
    order_figures,
    outbox_for,
    run_fleet,
    sqlite_commits,
    sqlite_ledger,
)
from tests.faults._scale import scale

pytestmark = [pytest.mark.faults]

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
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = random.Random(19)
    started = time.monotonic()
    path = tmp_path / "outbox.db"
    url, store_options = open_outbox_file(path)
    create_sqlite_tables(path)
    options = {"batch_size": BATCH, "lease": LEASE, "interval": 0.1}
    with (
        SQLiteStore(path) as watcher,
        OrderingFleet(
            url, "", tmp_path, options, sqlite_options=store_options, max_seconds=2 * TIMEOUT
        ) as fleet,
    ):
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
    checked = integrity(path)
    drain_log = tmp_path / "runs-drain.jsonl"
    drain_runs = RunLog(drain_log)
    try:
        with SQLiteStore(path) as store:
            assert drain_until_done(
                outbox_for(store, drain_runs, sqlite_ledger), timeout=60, lease=5.0
            )
    finally:
        drain_runs.close()
    result = figures(path, EVENTS, run.traces)
    order = order_figures(sqlite_commits(path), [*run.runs, drain_log], run.traces)
    wall = time.monotonic() - started
    with capsys.disabled():
        print(
            f"\n[faults:ordering-sqlite] {EVENTS} events, {order.keys} keys, {PUBLISHERS}"
            f" publishers, {POLLERS} pollers, {run.kills} kills, {run.freezes} freezes, {wall:.1f}s:"
            f" {order.line()} {result.line()}"
        )
    assert checked == "ok"
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


def _settled(store: SQLiteStore) -> bool:
    stats = store.stats(now=None)
    return stats.pending + stats.claimed == 0
