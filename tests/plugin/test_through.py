"""``outboxkit.testing.through`` and the assertions' window: every event of the test store, a
fixture's included; ``conn=`` reads inside the app's open transaction; an enqueue into another
database than the test store's is named. On memory, SQLite and PostgreSQL."""

from __future__ import annotations

import pytest

from tests.plugin.sample import run


def test_an_event_a_fixture_enqueued_before_the_drain_is_seen(any_app: pytest.Pytester) -> None:
    result = run(
        any_app,
        """
        import pytest
        from apphelpers import enqueue

        @pytest.fixture
        def placed(outbox):
            enqueue(outbox, "order.placed", {"order_id": 1})

        def test_seen(placed, outbox_drain):
            outbox_drain.assert_enqueued("order.placed", {"order_id": 1}, count=1)
            with pytest.raises(AssertionError, match="among the 1 'order.placed' event.s. in the test store"):
                outbox_drain.assert_enqueued("order.placed", {"order_id": 2})
            outbox_drain().assert_delivered("order.placed", handler="reserve-stock")
        """,
    )
    result.assert_outcomes(passed=1)


def test_assertions_read_inside_the_apps_open_transaction(any_app: pytest.Pytester) -> None:
    result = run(
        any_app,
        """
        import pytest

        def test_in_transaction(outbox, outbox_drain, outbox_store):
            with outbox_store.transaction() as conn:
                outbox.enqueue(conn, "order.placed", {"order_id": 7}, key="o-7")
                outbox_drain.assert_enqueued("order.placed", {"order_id": 7}, key="o-7", conn=conn)
                outbox_drain.refute_enqueued("order.placed", {"order_id": 8}, conn=conn)
                # not committed: invisible outside the transaction
                outbox_drain.refute_enqueued("order.placed")
                with outbox_drain.capture(conn=conn) as cap:
                    outbox.enqueue(conn, "order.placed", {"order_id": 8})
                cap.assert_enqueued("order.placed", {"order_id": 8}, count=1)
                cap.refute_enqueued("order.placed", {"order_id": 7})
            outbox_drain.assert_enqueued("order.placed", count=2)

        def test_rolled_back_is_gone(outbox, outbox_drain, outbox_store):
            with pytest.raises(RuntimeError):
                with outbox_store.transaction() as conn:
                    outbox.enqueue(conn, "order.placed", {"order_id": 9})
                    outbox_drain.assert_enqueued("order.placed", conn=conn)
                    raise RuntimeError("the app's transaction fails")
            outbox_drain.refute_enqueued("order.placed")
        """,
    )
    result.assert_outcomes(passed=2)


def test_an_enqueue_into_another_sqlite_file_is_named(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_shop_stray="""
        import sqlite3
        import pytest
        from outboxkit import DrainError, EventBus, Outbox, open_store

        bus = EventBus()
        bus.subscribe("order.placed", lambda event, ctx: None, name="noop")

        @pytest.fixture
        def outbox(outbox_store, outbox_clock):
            return Outbox(outbox_store, bus, clock=outbox_clock)

        def test_shop(outbox, outbox_drain, tmp_path):
            shop = tmp_path / "shop.db"      # the app's real database, migrated
            real = open_store(f"sqlite:///{shop}")
            real.migrate()
            real.close()
            conn = sqlite3.connect(shop)
            with conn:
                outbox.enqueue(conn, "order.placed", {"order_id": 1})
            conn.close()
            with pytest.raises(AssertionError, match="another database .*shop.db"):
                outbox_drain.assert_enqueued("order.placed")
            with pytest.raises(DrainError, match="another database .*shop.db.* outbox_store"):
                outbox_drain()
        """
    )
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


@pytest.mark.pg
def test_an_enqueue_into_another_postgres_database_is_named(app_pg: pytest.Pytester) -> None:
    # The app's real database holds the outbox tables under the same schema name, so the
    # enqueue through a connection to it succeeds, and the events land where no drain looks.
    result = run(
        app_pg,
        """
        import uuid
        import psycopg
        import pytest
        from psycopg import sql
        from urllib.parse import urlsplit, urlunsplit
        from outboxkit import DrainError, open_store

        def test_shop(outbox, outbox_drain, outbox_store):
            url = outbox_store.url
            name = f"outboxkit_shop_{uuid.uuid4().hex[:12]}"
            with psycopg.connect(url, autocommit=True) as admin:
                admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            shop = urlunsplit(urlsplit(url)._replace(path=f"/{name}"))
            try:
                real = open_store(shop, schema=outbox_store.names.schema)
                real.migrate()
                real.close()
                with psycopg.connect(shop) as conn:
                    outbox.enqueue(conn, "order.placed", {"order_id": 1})
                with pytest.raises(AssertionError, match=f"another database .*{name}"):
                    outbox_drain.assert_enqueued("order.placed")
                with pytest.raises(DrainError, match=f"another database .*{name}.* outbox_store"):
                    outbox_drain()
            finally:
                with psycopg.connect(url, autocommit=True) as admin:
                    admin.execute(
                        sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name))
                    )
        """,
    )
    result.assert_outcomes(passed=1)


def test_the_memory_store_refuses_another_stores_transaction(
    app_memory: pytest.Pytester,
) -> None:
    # A memory store has no database another connection could be on: a transaction of
    # another store is refused at the enqueue, nothing written to either.
    result = run(
        app_memory,
        """
        import pytest
        from outboxkit import ConfigurationError, MemoryStore

        def test_other(outbox, outbox_drain):
            other = MemoryStore()
            with pytest.raises(ConfigurationError, match="a transaction of the same store"):
                with other.transaction() as conn:
                    outbox.enqueue(conn, "order.placed", {"order_id": 1})
            assert other.stats(now=None).total == 0
            outbox_drain.refute_enqueued("order.placed")
            assert outbox_drain().deliveries == []
        """,
    )
    result.assert_outcomes(passed=1)


def test_on_the_apps_own_store_the_window_starts_at_the_drain_and_says_so(
    pytester: pytest.Pytester,
) -> None:
    # An outbox on the app's own store (not outbox_store's, fresh per test) may hold other
    # tests' events: the assertions look at what was enqueued since outbox_drain was set up,
    # and their messages say so.
    pytester.makepyfile(
        test_app_store="""
        import pytest
        from outboxkit import EventBus, MemoryStore, Outbox

        STORE = MemoryStore()  # the app's, shared by its tests
        bus = EventBus()

        @pytest.fixture
        def outbox(outbox_clock):
            return Outbox(STORE, bus, clock=outbox_clock)

        def enqueue(outbox, n):
            with outbox.store.transaction() as conn:
                outbox.enqueue(conn, "t", {"n": n})

        def test_first(outbox, outbox_drain):
            enqueue(outbox, 1)
            outbox_drain.assert_enqueued("t", {"n": 1}, count=1)

        def test_second(outbox, outbox_drain):
            enqueue(outbox, 2)
            outbox_drain.assert_enqueued("t", count=1)   # not the first test's
            with pytest.raises(AssertionError, match="since outbox_drain was set up .after event 1"):
                outbox_drain.assert_enqueued("t", {"n": 1})
        """
    )
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
