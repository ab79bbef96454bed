"""SIGKILL chaos with respawn on one SQLite file, through the shared SQLite harness.

Three pollers over three topics; one chosen at random is SIGKILLed every second for six seconds
(each kill aimed at a moment when some lease is held, so it lands anywhere: inside a delivery
transaction holding the write lock, between a mailer's outside effect and its record, in a claim)
and a new one spawned in its place, while events arrive in chunks. Then the file must pass
``PRAGMA integrity_check``, a fault-free drain delivers the rest, and the figures: nothing lost,
no ledger row twice, nothing stuck or dead, no double claim; the mailer's duplicates (expected
after a kill) bounded by kills x batch size.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from outboxkit import Outbox
from outboxkit_sqlite import SQLiteStore
from tests.faults._harness import chaos
from tests.faults._harness_sqlite import (
    SQLiteFleet,
    drain,
    enqueue,
    figures,
    integrity,
    open_outbox_file,
    wait_until,
)
from tests.faults._scale import scale

pytestmark = [pytest.mark.faults]

EVENTS = scale(pr=900, large=4500)
CHUNK = 50
POLLERS = 3
BATCH = 10
KILLS = scale(pr=6, large=12)
KILL_EVERY = 1.0
LEASE = 2.0


def test_sigkill_chaos_with_respawn(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(9)
    path = tmp_path / "outbox.db"
    url, store_options = open_outbox_file(path)
    options = {"batch_size": BATCH, "lease": LEASE, "interval": 0.1}
    started = time.monotonic()
    with SQLiteStore(path) as store:
        outbox = Outbox(store, load_entry_points=False)
        with SQLiteFleet(url, store_options, tmp_path, options, max_seconds=60) as fleet:
            for _ in range(POLLERS):
                fleet.spawn()
            assert fleet.wait_ready(30), "poller processes did not start"
            chaos(
                fleet,
                lambda count, start: enqueue(path, outbox, count, start=start),
                events=EVENTS,
                chunk=CHUNK,
                kills=KILLS,
                every=KILL_EVERY,
                rng=rng,
                # Aim at work in flight: kill once some lease is held (bounded wait).
                before_kill=lambda: wait_until(
                    lambda: store.stats(now=None).claimed > 0, 0.5, step=0.002
                ),
            )
            exit_codes = fleet.shutdown()
            kills = fleet.kills
            traces = fleet.traces()
    # The kills left the file sound (WAL recovery by the next connection, no torn pages).
    checked = integrity(path)
    assert drain(path, timeout=30)
    result = figures(path, EVENTS, traces)
    wall = time.monotonic() - started
    with capsys.disabled():
        print(
            f"\n[faults:sigkill-sqlite] {EVENTS} events, {POLLERS} pollers, {kills} kills, "
            f"{wall:.1f}s: {result.line()}"
        )
    assert checked == "ok"
    assert integrity(path) == "ok"
    assert kills == KILLS
    assert result.invariants() == (0, 0, 0, 0, 0)
    assert result.dup_ext <= kills * BATCH
    assert exit_codes.count(0) == POLLERS
    assert set(exit_codes) <= {0, -9}  # the survivors stopped cleanly, the killed by SIGKILL
