"""``outboxkit.testing.stores``: a fresh store per test, a PostgreSQL schema of its own."""

from __future__ import annotations

import ast
import contextlib
import inspect
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outboxkit import EventBus, FrozenClock, MemoryStore, Outbox, Store
from outboxkit.errors import ConfigurationError, StoreError
from outboxkit.testing import open_test_store, stores
from outboxkit_pg import PostgresStore
from outboxkit_sqlite import SQLiteStore
from tests.integration.pg.conftest import pg_url_from_env, require_server
from tests.integration.pg.conftest import test_url as pg_test_url


def enqueue_one(store: Store) -> None:
    outbox = Outbox(store, EventBus(), clock=FrozenClock(), load_entry_points=False)
    with store.transaction() as conn:
        outbox.enqueue(conn, "t", {})


def test_without_a_url_each_test_gets_a_migrated_sqlite_file_of_its_own(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with open_test_store(None, tmp_path / "a") as a, open_test_store(None, tmp_path / "b") as b:
        assert isinstance(a, SQLiteStore) and isinstance(b, SQLiteStore)
        assert a.path is not None and b.path is not None and a.path != b.path
        assert a.path.is_file()
        if Path("/dev/shm").is_dir():  # memory-backed storage: no disk flushes
            assert a.path.parent.parent == Path("/dev/shm")
        enqueue_one(a)  # migrated: the tables are there
        assert a.stats(now=None).total == 1
        assert b.stats(now=None).total == 0  # copies of the template, not one file
    # The next test gets a store emptied of the last one's events, ids from 1 again.
    with open_test_store(None, tmp_path / "a") as again:
        assert again.stats(now=None).total == 0
        enqueue_one(again)
        assert [e.id for e in again.events()] == [1]


def test_a_memory_url_gives_a_fresh_memory_store(tmp_path: Path) -> None:
    with open_test_store("memory://", tmp_path) as store:
        assert isinstance(store, MemoryStore)
        enqueue_one(store)
        assert store.stats(now=None).total == 1
    with open_test_store("memory://", tmp_path) as again:
        assert again.stats(now=None).total == 0


def schema_exists(schema: str) -> bool:
    with psycopg.connect(pg_url_from_env(), autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname = %s", (schema,))
        return row.fetchone() == (1,)


@pytest.mark.pg
def test_a_postgres_url_gets_a_schema_of_its_own_emptied_kept_then_dropped(
    tmp_path: Path,
) -> None:
    require_server(pg_url_from_env())
    url = pg_test_url(pg_url_from_env())
    with open_test_store(url, tmp_path, "tests/x.py::test_a") as store:
        assert isinstance(store, PostgresStore)
        schema = store.names.schema
        assert schema.startswith("outboxkit_test_")
        assert schema_exists(schema)
        with open_test_store(url, tmp_path, "tests/x.py::test_b") as other:
            assert other.names.schema != schema  # one schema per test at a time
            other_schema = other.names.schema
        enqueue_one(store)
        enqueue_one(store)
        assert store.stats(now=None).total == 2
    # Kept for the next test, emptied: ids from 1 again, on the same open store.
    with open_test_store(url, tmp_path, "tests/x.py::test_c") as again:
        assert again.names.schema in (schema, other_schema)
        assert again.stats(now=None).total == 0
        enqueue_one(again)
        assert [e.id for e in again.events()] == [1]
    stores.close_test_stores()  # the session's end
    assert not schema_exists(schema) and not schema_exists(other_schema)


@pytest.mark.pg
def test_a_kept_schema_is_kept_when_its_prepared_emptying_was_deallocated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The emptying runs prepared; psycopg deallocates every prepared statement of a
    connection after a test's ROLLBACK on it (here: the test deallocates them on every pooled
    connection), and the emptying is prepared again instead of the schema being dropped."""
    require_server(pg_url_from_env())
    url = pg_test_url(pg_url_from_env())
    stores.close_test_stores()
    sent: list[bool] = []  # per emptying sent: whether it was a resend
    send = stores._Emptying._send

    def counted(self: Any) -> None:
        sent.append(hasattr(self, "_flight"))
        send(self)

    monkeypatch.setattr(stores._Emptying, "_send", counted)
    with open_test_store(url, tmp_path) as store:
        assert isinstance(store, PostgresStore)
        schema = store.names.schema
        size = store.dialect.pool.max_size
    # Every pooled connection takes the emptying (prepared on it) in turn.
    for _ in range(3 * size):
        with open_test_store(url, tmp_path) as again:
            assert again.names.schema == schema
            enqueue_one(again)
    assert not any(sent)
    with open_test_store(url, tmp_path) as again, contextlib.ExitStack() as held:
        assert isinstance(again, PostgresStore)
        for _ in range(size):
            conn = held.enter_context(again.dialect.connection("test", check_schema=False))
            conn.execute("DEALLOCATE ALL")
    for _ in range(2 * size):
        with open_test_store(url, tmp_path) as again:
            assert again.names.schema == schema  # kept, not dropped for a new one
            assert again.stats(now=None).total == 0
            enqueue_one(again)
    assert any(sent)  # an emptying the server no longer knew, sent again, prepared again
    stores.close_test_stores()
    assert not schema_exists(schema)


@pytest.mark.pg
def test_the_schema_is_dropped_when_the_test_fails(tmp_path: Path) -> None:
    require_server(pg_url_from_env())
    url = pg_test_url(pg_url_from_env())
    schema = ""
    failing = pytest.raises(RuntimeError, match="the test failed")
    with failing, open_test_store(url, tmp_path) as store:
        assert isinstance(store, PostgresStore)
        schema = store.names.schema
        enqueue_one(store)
        raise RuntimeError("the test failed")
    with open_test_store(url, tmp_path) as again:
        assert again.stats(now=None).total == 0  # emptied all the same
    stores.close_test_stores()
    assert schema and not schema_exists(schema)


@pytest.mark.pg
def test_a_store_the_test_closed_is_dropped_not_kept(tmp_path: Path) -> None:
    require_server(pg_url_from_env())
    url = pg_test_url(pg_url_from_env())
    with open_test_store(url, tmp_path) as store:
        assert isinstance(store, PostgresStore)
        schema = store.names.schema
        store.close()
    assert not schema_exists(schema)


@pytest.mark.pg
@pytest.mark.parametrize("made", ["TABLE {}.ledger (n int)", "VIEW {}.recent AS SELECT 1 AS n"])
def test_a_schema_the_test_made_a_relation_in_is_dropped_not_kept(
    tmp_path: Path, made: str
) -> None:
    """The app's own table (or view) in the test schema: the next test gets a new schema, as
    without keeping; the delivery records and keys of a kept one are emptied with it."""
    from psycopg import sql

    require_server(pg_url_from_env())
    url = pg_test_url(pg_url_from_env())
    stores.close_test_stores()
    with open_test_store(url, tmp_path) as store:
        assert isinstance(store, PostgresStore)
        schema = store.names.schema
        with store.transaction() as conn:
            conn.execute(sql.SQL("CREATE " + made).format(sql.Identifier(schema)))
    # Its emptying was sent as the test ended, and refused: the next test that takes a store
    # reads that answer and drops the schema, then gets a new one.
    with open_test_store(url, tmp_path) as again:
        assert not schema_exists(schema)
        assert isinstance(again, PostgresStore)
        assert again.names.schema != schema
        kept = again.names.schema
        outbox = Outbox(again, EventBus(), clock=FrozenClock(), load_entry_points=False)
        outbox.bus.subscribe("t", lambda event, ctx: None, name="noop")
        with again.transaction() as conn:
            outbox.enqueue(conn, "t", {}, key="k")
        outbox.poller().run_once()
        assert len(again.records(1)) == 1
    with open_test_store(url, tmp_path) as third:  # kept: emptied, records and keys too
        assert isinstance(third, PostgresStore)
        assert third.names.schema == kept
        assert third.stats(now=None).total == 0 and third.records(1) == []
        with psycopg.connect(url, autocommit=True) as conn:
            keys = sql.Identifier(kept, third.names.keys)
            row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(keys)).fetchone()
        assert row == (0,)
    stores.close_test_stores()


def test_a_postgres_url_that_opens_another_store_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A plugin that registered postgresql:// for some other store: its test schema could never
    # be dropped, so the store is closed and refused before the test runs.
    opened: list[MemoryStore] = []

    def other_store(url: str, **options: object) -> MemoryStore:
        assert str(options["schema"]).startswith("outboxkit_test_")
        opened.append(MemoryStore())
        return opened[-1]

    monkeypatch.setattr(stores, "open_store", other_store)
    refused = pytest.raises(ConfigurationError, match="opened a MemoryStore, not a PostgresStore")
    with refused as info, open_test_store("postgresql://app:secret@nowhere/db", tmp_path):
        raise AssertionError("the test must not run")
    assert "secret" not in str(info.value)
    (store,) = opened
    with pytest.raises(StoreError, match="closed"):
        store.now()


@pytest.mark.pg
def test_postgres_schema_per_test_under_xdist(pytester: pytest.Pytester) -> None:
    pytest.importorskip("xdist")
    url = pg_test_url(pg_url_from_env())
    require_server(pg_url_from_env())
    used = pytester.path / "schemas.txt"
    pytester.makepyfile(
        test_many=f"""
        import pytest

        @pytest.mark.parametrize("n", range(6))
        def test_isolated(outbox, outbox_store, outbox_drain, n):
            assert outbox_store.stats(now=None).total == 0   # nothing from other tests
            assert outbox_store.names.schema.startswith("outboxkit_test_gw")
            with open({str(used)!r}, "a") as names:
                names.write(outbox_store.names.schema + "\\n")
            with outbox_store.transaction() as conn:
                outbox.enqueue(conn, "t", {{"n": n}})
            assert len(outbox_drain().published) == 1
        """
    )
    result = pytester.runpytest_subprocess(
        "-q", "-p", "no:cacheprovider", "-n", "2", f"--outbox-store={url}"
    )
    result.assert_outcomes(passed=6)
    # The run's own schemas, by name: this suite's other workers make schemas of the same
    # prefix at the same time (a count by prefix raced with them). Each worker keeps its
    # schema for its next test; no two workers share one; all are dropped at the end.
    schemas = used.read_text().split()
    by_worker = {name.split("_")[2] for name in schemas}
    assert len(set(schemas)) == len(by_worker) == 2
    assert not any(schema_exists(schema) for schema in set(schemas))


def test_no_store_is_probed_for_its_methods() -> None:
    # The PostgreSQL schema is dropped through PostgresStore.drop_schema, named and typed, not
    # found by looking for an attribute on whatever store came back.
    tree = ast.parse(inspect.getsource(stores))
    called = {
        n.func.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    }
    assert not called & {"getattr", "hasattr"}
