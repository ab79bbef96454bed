"""The seam's helpers for a store on a DB-API driver (``outboxkit.storekit.driver``) and for a
store package's plugin (``outboxkit.storekit.plugin``), on the standard library's ``sqlite3``
as the driver: the URL parser, the guarded connection class, the pooled dialect's blocks and
the lazily opened delivery's lifecycle."""

from __future__ import annotations

import contextlib
import sqlite3
import sys
import types
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import pytest

from outboxkit.core.model import Event, make_claim
from outboxkit.storekit import (
    ConfigurationError,
    HandlerCrashed,
    LeaseLostError,
    MissingDependency,
    Outcome,
    Reject,
    StoreError,
    StoreUnavailable,
)
from outboxkit.storekit.driver import (
    ConnectionPool,
    GuardedConnection,
    InBatch,
    LazyDelivery,
    PooledDelivery,
    PooledDialect,
    Script,
    parse_server_url,
    pooled_batch,
)
from outboxkit.storekit.plugin import StoreClass
from outboxkit.storekit.sql import JSONRows, NaiveUTC, Row, SQLBatch

AT = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


# -- parse_server_url -----------------------------------------------------------------------


def parse(url: Any) -> Any:
    return parse_server_url(url, schemes=("mydb", "mine"), port=5000, user="admin", store="MyDB")


def test_a_server_url_is_read_with_its_defaults_and_shown_without_its_password() -> None:
    full = parse("MINE://app%40corp:s%3Acret@db.example:7000/orders")
    assert (full.scheme, full.host, full.port, full.user, full.database) == (
        "mine",
        "db.example",
        7000,
        "app@corp",
        "orders",
    )
    assert full.password == "s:cret"
    assert "s:cret" not in full.shown and "s:cret" not in repr(full)
    assert full.connect_args()["password"] == "s:cret"
    bare = parse("mydb:///orders")
    assert (bare.host, bare.port, bare.user, bare.password) == ("127.0.0.1", 5000, "admin", "")


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql://app:hunter2@db/orders", "starts with 'mydb://'"),
        ("mydb://app:hunter2@db:5000", "names its database"),
        ("mydb://app:hunter2@db/a/b", "names its database"),
        ("mydb://app:hunter2@db/or`ders", "the URL's database"),
        (42, "starts with 'mydb://'"),
    ],
)
def test_a_bad_server_url_is_refused_naming_it_without_its_password(
    url: Any, expected: str
) -> None:
    with pytest.raises(ConfigurationError, match=expected) as raised:
        parse(url)
    assert "hunter2" not in str(raised.value)


# -- a DB-API store on sqlite3 --------------------------------------------------------------


class Driver(sqlite3.Connection):
    """The driver's connection class (with a ``begin``, as PyMySQL's)."""

    def begin(self) -> None:
        self.execute("BEGIN")


class Guarded(GuardedConnection, Driver):
    """A store's connection class: the mixin before the driver's. A deferred delivery's
    opening (``ahead``) runs before its next statement (sqlite3 sends one statement at a time:
    two calls here, where PyMySQL's store sends one flight)."""

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            try:
                owned = Dialect.script(ahead.dialect, self, ahead.opening)
            except sqlite3.Error as exc:
                raise ahead.opening_failed(exc) from exc
            if ahead.checks and owned != 1:
                raise ahead.stale_token()
        return super().execute(sql, *args)


class Dialect(NaiveUTC, JSONRows, PooledDialect):
    name = "sqlite"
    where = "a test database"
    driver_error = sqlite3.Error

    def __init__(self, path: Path) -> None:
        self.path = path
        self.made: list[Guarded] = []
        self.pool = ConnectionPool(
            self.connect, 2, reset=lambda c: not c.ended_by_handler, close=self.gone, what="it"
        )
        self.closed: list[Guarded] = []

    def connect(self) -> Guarded:
        conn = sqlite3.connect(self.path, factory=Guarded, isolation_level=None)
        conn.execute("CREATE TABLE IF NOT EXISTS rows (n INTEGER PRIMARY KEY)")
        self.made.append(conn)
        return conn

    def gone(self, conn: Guarded) -> None:
        conn.delivering = False
        conn.close()
        self.closed.append(conn)

    def map_error(self, exc: BaseException, doing: str) -> StoreError:
        kind = StoreUnavailable if self.outage(exc) else StoreError
        return kind(f"{self.where}: {doing} failed: {exc}")

    def outage(self, exc: BaseException) -> bool:
        return isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc)

    def rows(self, conn: Any, name: str, params: Mapping[str, Any]) -> list[Row]:
        return list(conn.execute(name, dict(params)).fetchall())

    def script(self, conn: Any, statements: Script) -> int:
        count = 0
        for sql, params in statements:
            count = sqlite3.Connection.execute(conn, sql, dict(params or {})).rowcount
        return count


class Delivery(LazyDelivery):
    """A delivery in a transaction of its own (or, in a batch, a savepoint of it)."""

    conn: Guarded

    def __init__(self, dialect: Dialect, conn: Guarded, *, stale: bool = False) -> None:
        event = Event(id=7, topic="t", payload={}, created_at=AT, available_at=AT, attempts=1)
        super().__init__(dialect, conn, make_claim(event, "token", AT, None), None)
        self.stale = stale
        self.steps: list[str] = []

    def open(self) -> None:
        self.opened = True
        self.conn.begin()
        self.conn.delivering = True
        self.steps.append("open")
        if self.stale:
            raise LeaseLostError("stale")

    def finish(self) -> None:
        self.conn.delivering = False
        self.check_kept()
        self.steps.append(f"finish {len(self.kept)}")
        self.conn.commit()

    def undo(self) -> None:
        self.conn.delivering = False
        self.steps.append("undo")
        self.conn.rollback()

    def fenced(self, params: dict[str, Any]) -> None:
        self.steps.append(f"fenced {params['handler']}")
        if self.stale:
            raise LeaseLostError("stale")


class Deferred(Delivery):
    """A delivery whose opening (BEGIN, then the token check: a row count of 1) is deferred to
    the handler's first statement (``LazyDelivery.defer``)."""

    def open(self) -> None:
        self.steps.append("defer")
        check = "UPDATE rows SET n = n WHERE n = :n"
        self.defer([("BEGIN", None), (check, {"n": -1 if self.stale else 0})])


@pytest.fixture
def dialect(tmp_path: Path) -> Iterator[Dialect]:
    made = Dialect(tmp_path / "store.db")
    yield made
    made.close()


def deliver(dialect: Dialect, **options: Any) -> PooledDelivery[Delivery]:
    return PooledDelivery(dialect, lambda conn: Delivery(dialect, conn, **options), "deliver")


def count(dialect: Dialect) -> int:
    with dialect.read("count") as conn:
        ((found,),) = conn.execute("SELECT count(*) FROM rows").fetchall()
    return int(found)


def test_a_delivery_never_opened_ends_with_its_one_record_fenced(dialect: Dialect) -> None:
    block = deliver(dialect)
    with block as tx:
        tx.record("h", Outcome.SUCCEEDED)
    assert block.tx.steps == ["fenced h"]
    assert len(dialect.pool.idle) == 1  # the connection back, kept


def test_a_delivery_whose_handler_writes_commits_its_writes_and_records(dialect: Dialect) -> None:
    block = deliver(dialect)
    with block as tx:
        tx.connection.execute("INSERT INTO rows VALUES (1)")
        tx.record("h", Outcome.SUCCEEDED)
        tx.record("g", Outcome.REJECTED, reason="no")
    assert block.tx.steps == ["open", "finish 2"]
    (conn,) = dialect.made
    assert count(dialect) == 1 and not conn.in_transaction


def test_a_handler_failure_rolls_back_and_is_the_handlers(dialect: Dialect) -> None:
    block = deliver(dialect)
    with pytest.raises(ValueError, match="boom"), block as tx:
        tx.connection.execute("INSERT INTO rows VALUES (1)")
        raise ValueError("boom")
    assert block.tx.steps == ["open", "undo"]
    assert count(dialect) == 0
    assert len(dialect.pool.idle) == 1


def test_an_outage_under_a_handler_is_the_stores_failure_whatever_the_handler_raised(
    dialect: Dialect,
) -> None:
    block = deliver(dialect)
    failed = pytest.raises(StoreUnavailable, match="the database failed under a handler")
    with failed as raised, block as tx:
        tx.connection.execute("INSERT INTO rows VALUES (1)")
        try:
            raise sqlite3.OperationalError("database is locked")
        except sqlite3.Error as exc:
            raise Reject("the handler's own reading of it") from exc
    assert isinstance(raised.value.__cause__, Reject)
    assert block.tx.steps == ["open", "undo"]


@pytest.mark.parametrize("what", ["commit", "rollback", "begin", "close"])
def test_a_handler_cannot_end_its_delivery_through_the_drivers_api(
    dialect: Dialect, what: str
) -> None:
    block = deliver(dialect)
    with pytest.raises(HandlerCrashed, match="may not commit or roll back"), block as tx:
        tx.connection.execute("INSERT INTO rows VALUES (1)")
        with contextlib.suppress(StoreError):  # a handler may swallow it: noted all the same
            getattr(tx.connection, what)()
        raise RuntimeError("then failed")
    (conn,) = dialect.made
    assert conn.ended_by_handler
    assert dialect.closed == [conn]  # not kept: its next user would inherit the attempt


def test_a_handler_that_swallowed_the_refusal_and_returned_is_crashed(dialect: Dialect) -> None:
    block = deliver(dialect)
    with pytest.raises(HandlerCrashed, match="tried to commit"), block as tx:
        tx.connection.execute("INSERT INTO rows VALUES (1)")
        with pytest.raises(StoreError, match="may not commit"):
            tx.connection.commit()
        tx.record("h", Outcome.SUCCEEDED)
    assert block.tx.steps == ["open", "undo"]
    assert count(dialect) == 0


def test_a_stale_token_writes_nothing_either_way(dialect: Dialect) -> None:
    with pytest.raises(LeaseLostError), deliver(dialect, stale=True) as tx:
        tx.record("h", Outcome.SUCCEEDED)
    block = deliver(dialect, stale=True)
    with pytest.raises(LeaseLostError), block as tx:
        tx.connection.execute("INSERT INTO rows VALUES (1)")
    assert block.tx.steps == ["open", "undo"]  # a failed opening is undone
    assert count(dialect) == 0


def test_an_undo_that_fails_closes_the_connection(dialect: Dialect) -> None:
    block = deliver(dialect)
    with pytest.raises(ValueError, match="boom"), block as tx:
        tx.connection.execute("INSERT INTO rows VALUES (1)")
        tx.conn.delivering = False
        tx.conn.close()  # the connection is gone under the delivery
        raise ValueError("boom")
    assert block.tx.broken
    assert dialect.closed == dialect.made


def test_a_batch_keeps_the_one_record_of_a_delivery_never_opened(dialect: Dialect) -> None:
    kept: list[tuple[Any, Any]] = []
    batch = types.SimpleNamespace(keep=lambda claim, params: kept.append((claim, params)))
    conn = dialect.pool.take()
    quiet = Delivery(dialect, conn)
    with InBatch(batch, quiet) as tx:  # type: ignore[arg-type]
        tx.record("h", Outcome.SUCCEEDED)
    assert [params["handler"] for _, params in kept] == ["h"] and quiet.steps == []
    writing = Delivery(dialect, conn)
    with InBatch(batch, writing) as tx:  # type: ignore[arg-type]
        tx.connection.execute("INSERT INTO rows VALUES (1)")
        tx.record("h", Outcome.SUCCEEDED)
    assert writing.steps == ["open", "finish 1"] and len(kept) == 1
    dialect.pool.give(conn)


def test_the_pooled_dialects_blocks_commit_roll_back_and_map_errors(dialect: Dialect) -> None:
    with dialect.write("write") as conn:
        conn.execute("INSERT INTO rows VALUES (1)")
    with pytest.raises(KeyError), dialect.write("write") as conn:
        conn.execute("INSERT INTO rows VALUES (2)")
        raise KeyError("the block's own")
    assert count(dialect) == 1
    failed = pytest.raises(StoreError, match="a test database: insert failed")
    with failed as raised, dialect.read("insert") as conn:
        conn.execute("INSERT INTO rows VALUES (1)")
    assert isinstance(raised.value.__cause__, sqlite3.IntegrityError)
    assert dialect.closed == dialect.made  # the failed block's connection is not kept


def test_the_value_mixins_bind_and_read_back(tmp_path: Path) -> None:
    dialect = Dialect(tmp_path / "values.db")
    assert dialect.instant(AT) == datetime(2026, 1, 2, 3, 4, 5)
    assert dialect.instant(None) is None
    with pytest.raises(ConfigurationError, match="timezone-aware"):
        dialect.instant(datetime(2026, 1, 1))
    assert dialect.stored_instant(datetime(2026, 1, 2, 3, 4, 5)) == AT
    assert dialect.duration(timedelta(seconds=1, microseconds=5)) == 1_000_005
    assert list(dialect.done('[["h", "succeeded"]]')) == [["h", "succeeded"]]
    assert list(dialect.done(None)) == []
    assert dialect.records_params([(1, datetime(2026, 1, 1))]) == {
        "items": '[[1, "2026-01-01 00:00:00"]]'
    }
    assert dialect.settle_params([(1, "a")]) == {"items": '[[1, "a"]]'}
    dialect.close()


# -- StoreClass ----------------------------------------------------------------------------


def test_a_store_class_is_imported_on_first_use_and_a_missing_driver_named() -> None:
    module = types.ModuleType("okx_fake_store")
    module.FakeStore = type(  # type: ignore[attr-defined]
        "FakeStore", (), {"from_url": classmethod(lambda cls, url, **o: (cls.__name__, url, o))}
    )
    sys.modules["okx_fake_store"] = module
    try:
        found = StoreClass(
            "okx_fake_store", "FakeStore", drivers=("x",), needs="X", extra="x", what="it"
        )
        assert found.open("fake://", a=1) == ("FakeStore", "fake://", {"a": 1})
    finally:
        del sys.modules["okx_fake_store"]
    missing = StoreClass(
        "okx_no_such_driver.store",
        "Store",
        drivers=("okx_no_such_driver",),
        needs="the No Such driver",
        extra="nosuch",
        what="the No Such store",
    )
    with pytest.raises(MissingDependency, match=r"needs the No Such driver .*outboxkit\[nosuch\]"):
        missing.load()
    other = StoreClass("okx_no_such_module", "S", drivers=("x",), needs="X", extra="x", what="it")
    with pytest.raises(ModuleNotFoundError):  # not the driver's: propagated as it is
        other.load()


def deferred(dialect: Dialect, **options: Any) -> PooledDelivery[Deferred]:
    with dialect.write("the row the check finds") as conn:
        conn.execute("INSERT OR IGNORE INTO rows VALUES (0)")
    return PooledDelivery(dialect, lambda conn: Deferred(dialect, conn, **options), "deliver")


def test_a_deferred_opening_goes_with_the_first_statement(dialect: Dialect) -> None:
    block = deferred(dialect)
    with block as tx:
        conn = tx.connection  # nothing sent yet
        assert conn.ahead is block.tx and not conn.in_transaction
        conn.execute("INSERT INTO rows VALUES (1)")
        assert conn.ahead is None and conn.in_transaction
        tx.record("h", Outcome.SUCCEEDED)
    assert block.tx.steps == ["defer", "finish 1"]
    assert count(dialect) == 2


def test_a_deferred_opening_never_sent_is_sent_alone_at_the_end(dialect: Dialect) -> None:
    block = deferred(dialect)
    with block as tx:
        assert tx.connection.ahead is block.tx
        tx.record("h", Outcome.SUCCEEDED)
    assert block.tx.steps == ["defer", "finish 1"]
    assert block.tx.conn.ahead is None


def test_a_deferred_opening_refused_stays_refused(dialect: Dialect) -> None:
    block = deferred(dialect, stale=True)
    with pytest.raises(LeaseLostError), block as tx:
        with contextlib.suppress(LeaseLostError):  # a handler that swallows it
            tx.connection.execute("INSERT INTO rows VALUES (1)")
        tx.record("h", Outcome.SUCCEEDED)
    assert block.tx.steps == ["defer", "undo"]  # the BEGIN it sent, rolled back
    assert count(dialect) == 1
    never = deferred(dialect, stale=True)
    with pytest.raises(LeaseLostError), never as tx:
        assert tx.connection is not None  # taken, never used: refused as the block ends
        tx.record("h", Outcome.SUCCEEDED)
    assert never.tx.steps == ["defer", "undo"]


def test_a_deferred_opening_never_sent_has_nothing_to_undo(dialect: Dialect) -> None:
    block = deferred(dialect)
    with pytest.raises(RuntimeError, match="boom"), block as tx:
        assert tx.connection.ahead is block.tx
        raise RuntimeError("boom")
    assert block.tx.steps == ["defer"]
    assert block.tx.conn.ahead is None
    assert len(dialect.pool.idle) == 1  # kept: nothing was sent, nothing is in doubt


def test_a_pooled_batch_commits_or_rolls_back_and_hands_its_connection_back(
    dialect: Dialect,
) -> None:
    def begin(conn: Guarded) -> None:
        conn.begin()

    def end(conn: Guarded, commit: bool) -> None:
        conn.execute("COMMIT" if commit else "ROLLBACK")

    class Batch(SQLBatch):
        def delivery(self, claim: Any, *, now: datetime | None) -> Any:
            raise NotImplementedError  # pragma: no cover - no delivery here

    def make(conn: Guarded) -> SQLBatch:
        return Batch(cast(Any, None), conn)  # nothing kept: its store is never asked

    with pooled_batch(dialect, make, begin, end) as batch:
        batch.conn.execute("INSERT INTO rows VALUES (5)")
    with (
        pytest.raises(RuntimeError, match="boom"),
        pooled_batch(dialect, make, begin, end) as batch,
    ):
        batch.conn.execute("INSERT INTO rows VALUES (6)")
        raise RuntimeError("boom")
    assert count(dialect) == 1
    assert len(dialect.pool.idle) == 1 and dialect.closed == []

    def end_failing(conn: Guarded, commit: bool) -> None:
        raise sqlite3.OperationalError("the connection is gone")

    with pytest.raises(RuntimeError, match="boom"), pooled_batch(dialect, make, begin, end_failing):
        raise RuntimeError("boom")  # the block's error, not the failed rollback's
    assert len(dialect.closed) == 1  # its rollback failed: in doubt, closed
