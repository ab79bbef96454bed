"""SIGKILL chaos with respawn on PostgreSQL, through the shared fault harness.

Three pollers over three topics; one chosen at random is SIGKILLed every second for six seconds
and a new one spawned in its place, while events arrive in chunks. Then a fault-free drain and
the figures: nothing lost, no ledger row twice, nothing stuck or dead, no double claim; the
mailer's duplicates (expected after a kill) bounded by kills x batch size.

Sizes: 900 events and 6 kills; with ``OUTBOXKIT_FAULTS_SCALE=large``, 4,500 events and 12 kills
(one a second for twelve seconds; see ``tests/faults/_scale.py``).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outboxkit import Outbox
from outboxkit_pg import PostgresStore
from tests.faults._harness import TOPICS, chaos, drain, enqueue, figures
from tests.faults._scale import scale
from tests.integration.pg._workers import Fleet, create_app_tables

pytestmark = [pytest.mark.pg, pytest.mark.faults]

EVENTS = scale(pr=900, large=4500)
CHUNK = 50
POLLERS = 3
BATCH = 10
KILLS = scale(pr=6, large=12)
KILL_EVERY = 1.0


@pytest.mark.parametrize("layout", ["plain", "partitioned"])
def test_sigkill_chaos_with_respawn(
    pg_url: str,
    pg_schema: str,
    admin: psycopg.Connection[Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    layout: str,
) -> None:
    # The partitioned layout: partitions of 200 ids, made ahead (ATTACH) while the pollers
    # claim and die, as the pollers' retention would every minute.
    store_options = {"partition_size": 200} if layout == "partitioned" else {}
    rng = random.Random(9)
    store = PostgresStore(pg_url, schema=pg_schema, **store_options)

    def arrive(count: int, start: int) -> list[int]:
        if store_options:
            store.maintain_partitions()
        return enqueue(pg_url, outbox, count, start=start)

    try:
        store.migrate()
        create_app_tables(admin, pg_schema)
        outbox = Outbox(store)
        options = {"batch_size": BATCH, "lease": 2.0, "interval": 0.2}
        with Fleet(
            pg_url, pg_schema, tmp_path, options, topics=TOPICS, store_options=store_options
        ) as fleet:
            for _ in range(POLLERS):
                fleet.spawn()
            assert fleet.wait_ready(60), "poller processes did not start"
            chaos(
                fleet,
                arrive,
                events=EVENTS,
                chunk=CHUNK,
                kills=KILLS,
                every=KILL_EVERY,
                rng=rng,
            )
            exit_codes = fleet.shutdown()
            kills = fleet.kills
        assert drain(pg_url, pg_schema, timeout=60, **store_options)
        result = figures(admin, pg_schema, EVENTS, fleet.traces())
    finally:
        store.close()
    with capsys.disabled():
        print(
            f"\n[faults:sigkill-pg] {layout} layout, {EVENTS} events, {POLLERS} pollers, "
            f"{kills} kills: "
            f"{result.line()}"
        )
    assert kills == KILLS
    assert result.invariants() == (0, 0, 0, 0, 0)
    assert result.dup_ext <= kills * BATCH
    assert exit_codes.count(0) == POLLERS
    assert set(exit_codes) <= {0, -9}  # the survivors stopped cleanly, the killed by SIGKILL
