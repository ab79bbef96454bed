"""The WAL watch: ``journal_size_limit``, the ``wal_warn_bytes`` option, and the warning when a
read transaction held open elsewhere keeps every checkpoint from getting through the WAL.

The store looks at the WAL's size at most every ``WAL_CHECK_INTERVAL`` seconds; the tests set
it to 0 so that every commit looks. The warning stays rate-limited (once a minute).
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

import outboxkit_sqlite.connections as sqlite_connections
from outboxkit import ConfigurationError, EventBus, Outbox, open_store
from outboxkit_sqlite import SQLiteStore

SMALL = 64 * 1024  # bytes: a few dozen pages of WAL


@pytest.fixture
def look_every_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sqlite_connections, "WAL_CHECK_INTERVAL", 0.0)


@pytest.fixture
def reader(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    """Another connection to the database file, in autocommit mode (``BEGIN`` it to hold)."""
    with closing(sqlite3.connect(tmp_path / "app.db", isolation_level=None)) as conn:
        yield conn


def _enqueue(store: SQLiteStore, transactions: int) -> None:
    outbox = Outbox(store, EventBus(), load_entry_points=False)
    for n in range(transactions):
        with store.transaction() as conn:
            outbox.enqueue_many(conn, [("wal.test", {"n": n, "pad": "x" * 2000})] * 10)


def _wal_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "outboxkit.sqlite" and r.levelno == logging.WARNING
    ]


def test_a_held_read_transaction_is_warned_about_once_a_minute(
    tmp_path: Path,
    reader: sqlite3.Connection,
    look_every_commit: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="outboxkit.sqlite")
    path = tmp_path / "app.db"
    with SQLiteStore(path, wal_warn_bytes=SMALL) as store:
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM outbox_events").fetchone()  # the snapshot
        _enqueue(store, 20)  # ~400 kB of WAL the checkpoints cannot get past
        assert (path.parent / "app.db-wal").stat().st_size > SMALL
        (warning,) = _wal_warnings(caplog)  # once, although every commit looked
        assert str(path) in warning and f"{path}-wal" in warning
        assert "wal_warn_bytes=65536" in warning
        assert "read transaction" in warning
        reader.execute("COMMIT")


def test_no_warning_while_checkpoints_get_through(
    tmp_path: Path, look_every_commit: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="outboxkit.sqlite")
    with SQLiteStore(tmp_path / "app.db", wal_warn_bytes=SMALL) as store:
        _enqueue(store, 20)  # over SMALL: checkpointed, completely
    assert _wal_warnings(caplog) == []


def test_the_wal_shrinks_back_once_the_reader_ends(
    tmp_path: Path,
    reader: sqlite3.Connection,
    look_every_commit: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sqlite_connections, "JOURNAL_SIZE_LIMIT", 256 * 1024)
    path = tmp_path / "app.db"
    wal = path.parent / "app.db-wal"
    with SQLiteStore(path, wal_warn_bytes=SMALL) as store:
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM outbox_events").fetchone()
        _enqueue(store, 60)  # ~1.2 MB
        grown = wal.stat().st_size
        assert grown > 1_000_000
        reader.execute("COMMIT")
        _enqueue(store, 2)  # the store's passive checkpoint gets through; the next commit resets
        assert wal.stat().st_size <= 256 * 1024 < grown


def test_store_connections_set_journal_size_limit(tmp_path: Path) -> None:
    with SQLiteStore(tmp_path / "app.db") as store, store.transaction() as conn:
        (limit,) = conn.execute("PRAGMA journal_size_limit").fetchone()
    assert limit == 32 * 1024 * 1024


def test_the_option_is_kept_for_other_processes(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'app.db'}"
    with open_store(url, wal_warn_bytes=SMALL) as store:
        assert isinstance(store, SQLiteStore)
        assert store.wal_warn_bytes == SMALL
        assert store.options["wal_warn_bytes"] == SMALL
        with open_store(store.url, **store.options) as again:
            assert isinstance(again, SQLiteStore) and again.wal_warn_bytes == SMALL
    with SQLiteStore(tmp_path / "default.db") as store:
        assert store.wal_warn_bytes == 64 * 1024 * 1024


@pytest.mark.parametrize("value", [0, -1, 1.5, "64", True, None])
def test_bad_wal_warn_bytes_is_refused(tmp_path: Path, value: Any) -> None:
    path = tmp_path / "app.db"
    for make in (
        lambda: SQLiteStore(path, wal_warn_bytes=value),
        lambda: open_store(f"sqlite:///{path}", wal_warn_bytes=value),
    ):
        with pytest.raises(ConfigurationError, match="wal_warn_bytes") as raised:
            make()
        assert repr(value) in str(raised.value)
    assert not path.exists()
