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
        test_shop="""
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
