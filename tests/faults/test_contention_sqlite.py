"""Multi-process contention on one SQLite file, through the shared SQLite fault harness.

Two publisher processes enqueue 600 events (through the app's own ``sqlite3`` connections, a few
per transaction) while three poller processes drain them: SQLite's single write lock is fought
over the whole time. No "database is locked" (or any other error) may reach a caller: every
publisher succeeds, every poller keeps running and logs no warning, and the figures are clean —
nothing lost, no ledger row twice, nothing stuck or dead, no double claim, and with no crash no
outside effect twice either.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path
from typing import Any

import pytest

from outboxkit_sqlite import SQLiteStore
from tests.faults._harness_sqlite import (
    SQLiteFleet,
    drain,
    figures,
    integrity,
    open_outbox_file,
    publish,
    traced_events,
    wait_until,
)
from tests.faults._scale import scale

pytestmark = [pytest.mark.faults]

EVENTS = scale(pr=600, large=3000)
PUBLISHERS = 2
PER_TRANSACTION = 5
POLLERS = 3
BATCH = 10
BUDGET = 60.0  # seconds for the whole fault phase; every process gives up by itself


def test_publishers_and_pollers_contend_without_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "outbox.db"
    url, store_options = open_outbox_file(path)
    deadline = time.time() + BUDGET
    context = multiprocessing.get_context("spawn")
    options = {"batch_size": BATCH, "lease": 5.0, "interval": 0.05}
    per_publisher = EVENTS // PUBLISHERS
    results = [tmp_path / f"publisher-{n}.json" for n in range(PUBLISHERS)]
    publishers: list[Any] = []
    started = time.monotonic()
    with SQLiteFleet(url, store_options, tmp_path, options, max_seconds=BUDGET) as fleet:
        try:
            for _ in range(POLLERS):
                fleet.spawn()
            assert fleet.wait_ready(30), "poller processes did not start"
            for n in range(PUBLISHERS):
                process = context.Process(
                    target=publish,
                    args=(
                        url,
                        store_options,
                        n * per_publisher,
                        per_publisher,
                        PER_TRANSACTION,
                        str(results[n]),
                        deadline,
                    ),
                    daemon=True,
                )
                process.start()
                publishers.append(process)
            for process in publishers:
                process.join(max(1.0, deadline - time.time()))
            publisher_codes = [p.exitcode for p in publishers]
            with SQLiteStore(path) as store:
                all_published = wait_until(
                    lambda: store.stats(now=None).published == EVENTS,
                    max(1.0, deadline - time.time()),
                    step=0.1,
                )
            wall = time.monotonic() - started
            live_before_shutdown = len(fleet.live())
        finally:
            for process in publishers:
                if process.is_alive():
                    process.kill()
                process.join(10)
        exit_codes = fleet.shutdown()
        logs = fleet.logs()
        traces = fleet.traces()
    assert drain(path, timeout=30)
    result = figures(path, EVENTS, traces)
    with capsys.disabled():
        print(
            f"\n[faults:contention-sqlite] {EVENTS} events, {PUBLISHERS} publishers + {POLLERS} "
            f"pollers, {wall:.1f}s: {result.line()}"
        )
    # Every publisher succeeded: no "database is locked" (nor anything else) reached the app.
    assert publisher_codes == [0] * PUBLISHERS
    reports = [json.loads(r.read_text(encoding="utf-8")) for r in results]
    for report in reports:
        assert report["errors"] == [], report["errors"]
        assert report["warnings"] == [], report["warnings"]
    ids = sorted(i for report in reports for i in report["ids"])
    assert len(ids) == len(set(ids)) == EVENTS
    assert traced_events(traces) == set(ids)  # the pollers' traces saw every claim
    # The pollers survived the whole time and never logged a store outage or any warning.
    assert all_published, "the pollers did not publish every event within the budget"
    assert live_before_shutdown == POLLERS
    assert "locked" not in logs
    assert not [line for line in logs.splitlines() if " WARNING " in line or " ERROR " in line]
    assert exit_codes == [0] * POLLERS
    assert integrity(path) == "ok"
    assert result.invariants() == (0, 0, 0, 0, 0)
    assert result.dup_ext == 0
