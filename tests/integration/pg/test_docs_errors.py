"""The errors page's retry loop runs as written: an app transaction under REPEATABLE READ that
enqueues with a dedupe key, run again on ``SerializationFailure`` (here it wins at once)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from outboxkit import EventBus, Outbox
from outboxkit_pg import PostgresStore
from tests.docs import page, python_blocks

pytestmark = pytest.mark.pg


def test_the_serialization_failure_loop(pg_url: str, pg_store: PostgresStore) -> None:
    (loop,) = python_blocks(page("reference/errors.md"))
    outbox = Outbox(pg_store, EventBus())

    def place_order(conn: Any, cart: list[str]) -> int:
        return len(cart)

    with psycopg.connect(pg_url) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.autocommit = True  # conn.transaction() begins and commits
        namespace = {"conn": conn, "outbox": outbox, "place_order": place_order, "cart": ["tea"]}
        exec(compile(loop, "docs/reference/errors.md", "exec"), namespace)
    assert namespace["attempt"] == 0
    (event,) = pg_store.events()
    assert event.topic == "order.placed" and event.payload == {"id": 1}
    with psycopg.connect(pg_url) as conn:  # a second run of the loop: the dedupe key holds
        conn.autocommit = True
        namespace["conn"] = conn
        exec(compile(loop, "docs/reference/errors.md", "exec"), namespace)
    assert len(pg_store.events()) == 1
