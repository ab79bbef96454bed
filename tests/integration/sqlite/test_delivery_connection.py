"""``SQLiteStore.delivery`` takes one of the store's connections for its block and hands it back
however the block ends: recorded, raised, refused for a stale token, or its connection taken
by the handler; on ``:memory:`` (one connection under a lock) another thread can use the store
after each."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from outboxkit import Event, EventBus, FrozenClock, LeaseLostError, Outbox, Outcome, StoreError
from outboxkit.core.model import Claim
from outboxkit.core.payload import build_event
from outboxkit_sqlite import SQLiteStore

NOW = datetime(2030, 1, 1, tzinfo=UTC)
LEASE = timedelta(seconds=30)


class Boom(Exception):
    pass


def _recorded(store: SQLiteStore, claim: Claim) -> None:
    with store.delivery(claim, now=NOW) as tx:
        tx.record("h", Outcome.SUCCEEDED)


def _raised(store: SQLiteStore, claim: Claim) -> None:
    with pytest.raises(Boom), store.delivery(claim, now=NOW) as tx:
        tx.connection.execute("SELECT 1")
        raise Boom


def _stale(store: SQLiteStore, claim: Claim) -> None:
    store.claim(batch_size=10, lease=LEASE, now=NOW + 2 * LEASE)  # taken over
    with pytest.raises(LeaseLostError), store.delivery(claim, now=NOW) as tx:
        tx.record("h", Outcome.SUCCEEDED)


def _opened(store: SQLiteStore, claim: Claim) -> None:
    with store.delivery(claim, now=NOW) as tx:
        tx.connection.execute("SELECT 1")
        tx.record("h", Outcome.SUCCEEDED)


ENDINGS = {"recorded": _recorded, "raised": _raised, "stale": _stale, "opened": _opened}


@pytest.fixture(params=["file", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SQLiteStore]:
    where = str(tmp_path / "d.db") if request.param == "file" else ":memory:"
    with SQLiteStore(where) as store:
        yield store


def _claim(store: SQLiteStore) -> Claim:
    with store.transaction() as conn:
        store.enqueue(conn, [build_event("t", {"n": 1})], now=NOW)
    (claim,) = store.claim(batch_size=10, lease=LEASE, now=NOW)
    return claim


@pytest.mark.parametrize("ending", ENDINGS)
def test_the_connection_comes_back_however_the_delivery_ends(
    store: SQLiteStore, ending: str
) -> None:
    end: Callable[[SQLiteStore, Claim], None] = ENDINGS[ending]
    end(store, _claim(store))
    pool = store.dialect.connections
    if pool._shared is None:
        assert len(pool._idle) == 1  # the one the delivery took, back and reused each time
        assert not pool._idle[0].in_transaction
    else:
        assert not pool._shared.in_transaction
    stats: list[int] = []
    other = threading.Thread(target=lambda: stats.append(store.stats(now=NOW).total))
    other.start()
    other.join(timeout=10)  # a bound, not a wait: the thread finds the store free at once
    assert stats == [1]


def test_a_closed_store_refuses_a_delivery_and_keeps_nothing(store: SQLiteStore) -> None:
    claim = _claim(store)
    store.close()
    with pytest.raises(StoreError, match="closed"), store.delivery(claim, now=NOW):
        pass


@pytest.mark.parametrize("memory", [False, True], ids=["file", "memory"])
def test_a_handlers_pragmas_do_not_reach_the_next_delivery(tmp_path: Path, memory: bool) -> None:
    """R18 on SQLite: a handler that changes its connection's settings (``PRAGMA query_only``,
    ``foreign_keys``, ``busy_timeout``) leaves the next delivery, on the same connection, with
    the store's own."""
    path = ":memory:" if memory else tmp_path / "app.db"
    pragmas = ("query_only", "foreign_keys", "busy_timeout")
    with SQLiteStore(path) as store:
        with store.transaction() as conn:
            store.enqueue(conn, [build_event("t", 1), build_event("t", 2)], now=NOW)
        first, second = store.claim(batch_size=10, lease=LEASE, now=NOW)
        seen = []
        with store.delivery(first, now=NOW) as tx:
            defaults = tuple(tx.connection.execute(f"PRAGMA {p}").fetchone()[0] for p in pragmas)
            seen.append(id(tx.connection))
            for statement in ("query_only=1", "foreign_keys=1", "busy_timeout=1"):
                tx.connection.execute(f"PRAGMA {statement}")
            tx.record("h", Outcome.SUCCEEDED)
        with store.delivery(second, now=NOW) as tx:
            after = tuple(tx.connection.execute(f"PRAGMA {p}").fetchone()[0] for p in pragmas)
            seen.append(id(tx.connection))
            tx.record("h", Outcome.SUCCEEDED)
    assert seen[0] == seen[1]  # the same connection
    assert defaults[:2] == (0, 0) and defaults[2] > 1
    assert after == defaults


def test_a_handlers_query_only_does_not_stop_its_batchs_records(tmp_path: Path) -> None:
    """R18 in ``per_batch``: a handler that makes its connection read-only after its write
    does not make the batch's own writes fail (its records, kept for the settlement, and the
    settlement itself), nor the next handler's."""
    with SQLiteStore(tmp_path / "app.db") as store:
        with store.transaction() as conn:
            conn.execute("CREATE TABLE ledger (event_id INTEGER NOT NULL)")
        bus = EventBus()

        def handle(event: Event, ctx: Any) -> None:
            ctx.connection.execute("INSERT INTO ledger VALUES (?)", (event.id,))
            ctx.connection.execute("PRAGMA query_only=1")

        bus.subscribe("t", handle, name="h", transactional=True)
        outbox = Outbox(store, bus, clock=FrozenClock(), load_entry_points=False)
        with store.transaction() as conn:
            ids = outbox.enqueue_many(conn, [("t", {"n": n}) for n in range(3)])
        report = outbox.poller(transaction="per_batch").run_once()
        assert sorted(report.published) == ids
        with store.transaction() as conn:
            rows = conn.execute("SELECT event_id FROM ledger ORDER BY 1").fetchall()
        assert [r[0] for r in rows] == ids
        for event_id in ids:
            assert [r.outcome for r in store.records(event_id)] == [Outcome.SUCCEEDED]
