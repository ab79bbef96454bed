"""Helpers shared by the benchmark scripts (not a benchmark itself).

The scripts run as ``python bench/<name>.py``; Python puts ``bench/`` on ``sys.path``, so they
import this module as ``_common`` (spawned child processes get the same path).
"""

from __future__ import annotations

import os
import secrets
import statistics
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

DEFAULT_PG_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
PG_URL_ENV = "OUTBOXKIT_BENCH_PG_URL"


def pg_url_default() -> str:
    """The PostgreSQL URL: ``$OUTBOXKIT_BENCH_PG_URL``, else the local trust-auth server."""
    return os.environ.get(PG_URL_ENV, DEFAULT_PG_URL)


def fresh_schema_name(prefix: str = "outboxkit_bench") -> str:
    return f"{prefix}_{os.getpid()}_{secrets.token_hex(3)}"


@contextmanager
def pg_schema(url: str, prefix: str = "outboxkit_bench") -> Iterator[str]:
    """A fresh, empty PostgreSQL schema, dropped (CASCADE) afterwards whatever happens."""
    import psycopg
    from psycopg import sql

    name = fresh_schema_name(prefix)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
    try:
        yield name
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def percentile(samples: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0-100), nearest rank, of ``samples``."""
    ordered = sorted(samples)
    if not ordered:
        return float("nan")
    rank = max(0, min(len(ordered) - 1, round(p / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples) if samples else float("nan")


def fill_outbox(outbox: Any, topic: str, events: int) -> None:
    """Enqueue ``events`` events of ``topic`` (payload ``{"n": n}``) through ``outbox``, 1,000
    to a transaction of its store's."""
    store = outbox.store
    for start in range(0, events, 1000):
        with store.transaction() as tx:
            outbox.enqueue_many(
                tx, [(topic, {"n": n}) for n in range(start, min(events, start + 1000))]
            )
