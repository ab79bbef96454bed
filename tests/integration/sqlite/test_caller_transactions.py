"""enqueue joins the app's own transaction, whatever its style.

Each caller style x {raise after enqueue -> 0 rows in the app table and the outbox; commit -> 1
row in both}. ``enqueue`` never begins, commits or rolls back: the app's transaction decides.
"""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, closing, contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlite_utils import Database

from outboxkit import ConfigurationError, EventBus, FrozenClock, Outbox
from outboxkit_sqlite import SQLiteStore

AppTransaction = Callable[[Path, SQLiteStore], AbstractContextManager[Any]]


@contextmanager
def default_isolation(path: Path, store: SQLiteStore) -> Iterator[sqlite3.Connection]:
    """Python 3.11's default: the driver opens the transaction before the first write."""
    with closing(sqlite3.connect(path, timeout=30)) as conn, conn:
        yield conn


@contextmanager
def explicit_begin(path: Path, store: SQLiteStore) -> Iterator[sqlite3.Connection]:
    """``isolation_level=None`` and the app's own BEGIN / COMMIT / ROLLBACK."""
    with closing(sqlite3.connect(path, timeout=30, isolation_level=None)) as conn:
        conn.execute("BEGIN")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")


@contextmanager
def autocommit_false(path: Path, store: SQLiteStore) -> Iterator[sqlite3.Connection]:
    """Python 3.12+ ``autocommit=False``: a transaction is always open; commit()/rollback()."""
    connect: Any = sqlite3.connect
    with closing(connect(path, timeout=30, autocommit=False)) as conn:
        try:
            yield conn
        except BaseException:
            conn.rollback()
            raise
        conn.commit()


@contextmanager
def sqlite_utils_atomic(path: Path, store: SQLiteStore) -> Iterator[Database]:
    """A ``sqlite_utils.Database`` inside ``db.atomic()``; enqueue uses its ``.conn``."""
    db = Database(path)
    try:
        with db.atomic():
            yield db
    finally:
        db.close()


@contextmanager
def store_transaction(path: Path, store: SQLiteStore) -> Iterator[sqlite3.Connection]:
    """The store's own connection (``store.transaction()``), for apps without one."""
    with store.transaction() as conn:
        yield conn


STYLES = [
    pytest.param(default_isolation, id="python-default-isolation"),
    pytest.param(explicit_begin, id="isolation-none-explicit-begin"),
    pytest.param(
        autocommit_false,
        id="autocommit-false",
        marks=pytest.mark.skipif(
            sys.version_info < (3, 12), reason="sqlite3 autocommit= needs Python 3.12+"
        ),
    ),
    pytest.param(sqlite_utils_atomic, id="sqlite-utils-atomic"),
    pytest.param(store_transaction, id="store-transaction"),
]


@pytest.fixture
def outbox(store: SQLiteStore) -> Outbox:
    return Outbox(store, EventBus(), clock=FrozenClock("2030-01-01T00:00:00Z"))


def counts(path: Path, store: SQLiteStore) -> tuple[int, int]:
    """(app rows, outbox events), read from a fresh connection: only committed rows count."""
    with closing(sqlite3.connect(path)) as conn:
        (orders,) = conn.execute("SELECT count(*) FROM orders").fetchone()
    return orders, store.stats(now=None).total


class AppFailed(Exception):
    pass


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize(
    "enqueue_first", [False, True], ids=["insert-then-enqueue", "enqueue-first"]
)
def test_raise_after_enqueue_leaves_no_rows(
    style: AppTransaction, enqueue_first: bool, path: Path, store: SQLiteStore, outbox: Outbox
) -> None:
    with pytest.raises(AppFailed), style(path, store) as conn:
        if not enqueue_first:
            conn.execute("INSERT INTO orders (id, item) VALUES (?, ?)", (1, "book"))
        outbox.enqueue(conn, "order.placed", {"order_id": 1})
        if enqueue_first:
            conn.execute("INSERT INTO orders (id, item) VALUES (?, ?)", (1, "book"))
        raise AppFailed("the app fails after enqueue")
    assert counts(path, store) == (0, 0)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize(
    "enqueue_first", [False, True], ids=["insert-then-enqueue", "enqueue-first"]
)
def test_commit_writes_one_row_in_both(
    style: AppTransaction, enqueue_first: bool, path: Path, store: SQLiteStore, outbox: Outbox
) -> None:
    with style(path, store) as conn:
        if not enqueue_first:
            conn.execute("INSERT INTO orders (id, item) VALUES (?, ?)", (1, "book"))
        event_id = outbox.enqueue(conn, "order.placed", {"order_id": 1})
        if enqueue_first:
            conn.execute("INSERT INTO orders (id, item) VALUES (?, ?)", (1, "book"))
        # Not committed yet: enqueue never commits the app's transaction.
        assert counts(path, store) == (0, 0)
    assert counts(path, store) == (1, 1)
    event = store.get(event_id)
    assert event is not None and event.payload == {"order_id": 1}


@pytest.mark.parametrize("style", STYLES)
def test_enqueue_many_is_one_statement_in_the_callers_transaction(
    style: AppTransaction, path: Path, store: SQLiteStore, outbox: Outbox
) -> None:
    statements: list[str] = []
    with style(path, store) as conn:
        raw = conn.conn if isinstance(conn, Database) else conn
        raw.set_trace_callback(statements.append)
        ids = outbox.enqueue_many(conn, [("t", n) for n in range(300)])
        raw.set_trace_callback(None)
    inserts = [s for s in statements if s.lstrip().upper().startswith("INSERT")]
    assert len(inserts) == 1
    assert not any(s.strip().upper() in ("COMMIT", "ROLLBACK") for s in statements)
    assert ids == sorted(ids) and len(set(ids)) == 300
    assert [store.get(i).payload for i in (ids[0], ids[-1])] == [0, 299]  # type: ignore[union-attr]


def test_large_batches_are_chunked_to_the_variable_limit(
    path: Path, store: SQLiteStore, outbox: Outbox
) -> None:
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 60)  # 10 events per INSERT
        ids = outbox.enqueue_many(conn, [("t", n) for n in range(25)])
    assert len(set(ids)) == 25
    assert [e.payload for e in store.events()] == list(range(25))


def test_autocommit_connection_without_a_transaction_is_refused(
    path: Path, store: SQLiteStore, outbox: Outbox
) -> None:
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        with pytest.raises(ConfigurationError, match="needs an open transaction"):
            outbox.enqueue(conn, "t", {"n": 1})
        assert conn.total_changes == 0
    assert counts(path, store) == (0, 0)


@pytest.mark.skipif(sys.version_info < (3, 12), reason="sqlite3 autocommit= needs Python 3.12+")
def test_autocommit_true_without_a_transaction_is_refused(
    path: Path, store: SQLiteStore, outbox: Outbox
) -> None:  # pragma: no cover - Python 3.12+
    connect: Any = sqlite3.connect
    with (
        closing(connect(path, autocommit=True)) as conn,
        pytest.raises(ConfigurationError, match="needs an open transaction"),
    ):
        outbox.enqueue(conn, "t", {"n": 1})
    assert counts(path, store) == (0, 0)


def test_sqlite_utils_outside_atomic_is_refused(
    path: Path, store: SQLiteStore, outbox: Outbox
) -> None:
    # sqlite-utils commits every write made outside db.atomic(): an enqueue there would not
    # belong to any transaction of the app's.
    db = Database(path)
    try:
        with pytest.raises(ConfigurationError, match=r"db\.atomic\(\)"):
            outbox.enqueue(db, "t", {"n": 1})
    finally:
        db.close()
    assert counts(path, store) == (0, 0)


def test_not_a_sqlite_connection_is_refused(store: SQLiteStore, outbox: Outbox) -> None:
    with pytest.raises(ConfigurationError, match=r"sqlite3\.Connection"):
        outbox.enqueue(object(), "t", {"n": 1})
