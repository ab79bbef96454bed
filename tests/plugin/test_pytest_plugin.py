"""The pytest plugin, tested the way users meet it: a sample app and its tests, run by pytester."""

from __future__ import annotations

import psycopg
import pytest

from tests.integration.pg.conftest import pg_url_from_env, require_server
from tests.integration.pg.conftest import test_url as pg_test_url

pytest_plugins = ["pytester"]

SAMPLE_APP = """
from outboxkit import EventBus, MemoryStore, Outbox, Reject

bus = EventBus()
calls = {"flaky": 0}


@bus.handler("order.placed", name="reserve-stock")
def reserve_stock(event, ctx):
    ctx.enqueue("stock.reserved", {"order_id": event.payload["order_id"]})


@bus.handler("order.placed", name="fraud-check")
def fraud_check(event, ctx):
    if event.payload.get("fraud"):
        raise Reject("looks fraudulent")


@bus.handler("stock.reserved", name="notify-warehouse")
def notify_warehouse(event, ctx):
    pass


@bus.handler("payment.captured", name="flaky-ledger")
def flaky_ledger(event, ctx):
    calls["flaky"] += 1
    if ctx.attempt <= event.payload["fail_times"]:
        raise ConnectionError(f"ledger down (attempt {ctx.attempt})")


@bus.handler("email.requested", name="broken-mailer")
def broken_mailer(event, ctx):
    raise RuntimeError("smtp exploded")


@bus.handler("ping", name="ping-pong")
def ping_pong(event, ctx):
    ctx.enqueue("pong", {})


@bus.handler("pong", name="pong-ping")
def pong_ping(event, ctx):
    ctx.enqueue("ping", {})


outbox = Outbox(MemoryStore(), bus, max_retries=10)
"""

HELPERS = """
def enqueue(outbox, topic, payload, **kw):
    with outbox.store.transaction() as conn:
        return outbox.enqueue(conn, topic, payload, **kw)
"""


@pytest.fixture(
    params=[pytest.param("sqlite", id="sqlite"), pytest.param("pg", id="pg", marks=pytest.mark.pg)]
)
def app(request: pytest.FixtureRequest, pytester: pytest.Pytester) -> pytest.Pytester:
    """The sample app, its ini, and the store: the default SQLite file per test, or PostgreSQL
    through ``--outbox-store`` (a schema per test, dropped afterwards)."""
    pytester.makepyfile(myapp=SAMPLE_APP, apphelpers=HELPERS)
    pytester.makeini(
        """
        [pytest]
        outboxkit_app = myapp:outbox
        filterwarnings = error
        """
    )
    pytester.syspathinsert()
    STORE_ARGS[id(pytester)] = store_args(request.param)
    STORE_CLASS[id(pytester)] = {"sqlite": "SQLiteStore", "pg": "PostgresStore"}[request.param]
    return pytester


STORE_ARGS: dict[int, list[str]] = {}
STORE_CLASS: dict[int, str] = {}


def store_args(backend: str) -> list[str]:
    if backend == "sqlite":
        return []
    url = pg_url_from_env()
    require_server(url)
    return [f"--outbox-store={pg_test_url(url)}"]


def run(app: pytest.Pytester, source: str, *args: str) -> pytest.RunResult:
    app.makepyfile(test_sample=source)
    return app.runpytest_inprocess("-q", "-p", "no:cacheprovider", *STORE_ARGS[id(app)], *args)


def test_drain_delivers_cascades_and_rejections(app: pytest.Pytester) -> None:
    result = run(
        app,
        """
        from apphelpers import enqueue

        def test_order(outbox, outbox_drain):
            enqueue(outbox, "order.placed", {"order_id": 1})
            enqueue(outbox, "order.placed", {"order_id": 2, "fraud": True})
            report = outbox_drain()
            assert report.rounds == 2          # the orders, then the stock.reserved follow-ups
            report.assert_delivered("order.placed", handler="reserve-stock", count=2)
            report.assert_rejected("order.placed", handler="fraud-check", count=1)
            report.assert_delivered("stock.reserved", handler="notify-warehouse", count=2)
            assert len(report.published) == 4
            assert report.topics_per_round == [
                ["order.placed", "order.placed"], ["stock.reserved", "stock.reserved"]
            ]
            assert report.advanced.total_seconds() == 0
        """,
    )
    result.assert_outcomes(passed=1)


def test_backoff_to_dead_letter_takes_no_real_time(app: pytest.Pytester) -> None:
    result = run(
        app,
        """
        import time
        from datetime import timedelta
        from apphelpers import enqueue

        def test_dead(outbox, outbox_drain, outbox_clock, monkeypatch):
            def no_sleep(seconds):
                raise AssertionError(f"slept {seconds}s")
            monkeypatch.setattr(time, "sleep", no_sleep)
            start = outbox_clock.now()
            enqueue(outbox, "email.requested", {"to": "a@example.com"})
            report = outbox_drain(raise_errors=False)
            report.assert_dead_lettered("email.requested", count=1)
            runs = report.deliveries_to(handler="broken-mailer")
            assert [d.attempt for d in runs] == list(range(1, 12))
            gaps = [(b.at - a.at).total_seconds() for a, b in zip(runs, runs[1:])]
            assert gaps == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]
            assert runs[0].at == start
            assert report.advanced == timedelta(seconds=sum(gaps))
            (dead,) = outbox.dead_letters()
            assert dead.event.attempts == 11
            assert dead.failed_at == start + report.advanced
        """,
    )
    result.assert_outcomes(passed=1)


def test_infinite_cascade_names_the_topic_chain(app: pytest.Pytester) -> None:
    result = run(
        app,
        """
        import pytest
        from outboxkit import DrainError
        from apphelpers import enqueue

        def test_loop(outbox, outbox_drain):
            enqueue(outbox, "ping", {})
            with pytest.raises(DrainError) as info:
                outbox_drain(max_rounds=6)
            assert "max_rounds=6" in str(info.value)
            assert "ping -> pong -> ping -> pong -> ping -> pong" in str(info.value)
        """,
    )
    result.assert_outcomes(passed=1)


def test_handler_errors_are_raised_together_with_the_report(app: pytest.Pytester) -> None:
    result = run(
        app,
        """
        import pytest
        from outboxkit.testing import HandlerErrors
        from apphelpers import enqueue

        def test_errors(outbox, outbox_drain):
            enqueue(outbox, "payment.captured", {"fail_times": 2})
            enqueue(outbox, "email.requested", {})
            with pytest.raises(HandlerErrors) as info:
                outbox_drain()
            group = info.value
            assert {type(e).__name__ for e in group.exceptions} == {"ConnectionError", "RuntimeError"}
            assert len(group.exceptions) == 2 + 11
            # every outcome was recorded before raising
            group.report.assert_delivered("payment.captured", handler="flaky-ledger", count=1)
            group.report.assert_dead_lettered("email.requested")

        def test_expected(outbox, outbox_drain):
            enqueue(outbox, "payment.captured", {"fail_times": 3})
            with outbox_drain.expect_failures("flaky-ledger"):
                report = outbox_drain()
            assert [d.outcome.value for d in report.deliveries] == ["failed"] * 3 + ["succeeded"]
            assert [r for r in report.retried] == [report.published[0]] * 3

        def test_expected_by_type(outbox, outbox_drain):
            enqueue(outbox, "payment.captured", {"fail_times": 1})
            with outbox_drain.expect_failures(ConnectionError):
                outbox_drain().assert_delivered("payment.captured")

        def test_unexpected_type_still_raises(outbox, outbox_drain):
            enqueue(outbox, "email.requested", {})
            with outbox_drain.expect_failures(ConnectionError), pytest.raises(HandlerErrors):
                outbox_drain()
        """,
    )
    result.assert_outcomes(passed=4)


def test_scheduled_events_wait_for_until(app: pytest.Pytester) -> None:
    result = run(
        app,
        """
        from datetime import timedelta
        from apphelpers import enqueue

        def test_later(outbox, outbox_drain, outbox_clock):
            start = outbox_clock.now()
            enqueue(outbox, "stock.reserved", {"order_id": 9}, delay=3600)
            report = outbox_drain()
            assert report.deliveries == []
            assert [e.topic for e in report.pending] == ["stock.reserved"]
            assert outbox_clock.now() == start
            report = outbox_drain(until=timedelta(minutes=59))
            assert report.deliveries == []
            report = outbox_drain(until=timedelta(hours=2))
            report.assert_delivered("stock.reserved")
            assert report.deliveries[0].at == start + timedelta(hours=1)
            assert report.pending == []
        """,
    )
    result.assert_outcomes(passed=1)


def test_report_assertions_fail_readably(app: pytest.Pytester) -> None:
    result = run(
        app,
        """
        from apphelpers import enqueue

        def test_wrong(outbox, outbox_drain):
            enqueue(outbox, "stock.reserved", {"order_id": 1})
            report = outbox_drain()
            report.assert_rejected("stock.reserved")

        def test_compare(outbox, outbox_drain):
            enqueue(outbox, "stock.reserved", {"order_id": 1})
            report = outbox_drain()
            assert report == None
        """,
    )
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*expected rejected 'stock.reserved' at least once, found 0*",
            "*DrainReport: 1 round(s), 1 deliveries, 1 published*",
            "*event 1 'stock.reserved' -> notify-warehouse: succeeded on attempt 1*",
            "*comparing a DrainReport (==)*",
        ]
    )


def test_enqueue_assertions_and_capture(app: pytest.Pytester) -> None:
    result = run(
        app,
        """
        import pytest
        from apphelpers import enqueue

        def test_enqueued(outbox, outbox_drain):
            enqueue(outbox, "order.placed", {"order_id": 1, "total": 10})
            enqueue(outbox, "order.placed", {"order_id": 2, "total": 20})
            outbox_drain.assert_enqueued("order.placed", {"order_id": 2})
            outbox_drain.assert_enqueued("order.placed", count=2)
            outbox_drain.refute_enqueued("order.placed", {"order_id": 3})
            outbox_drain.refute_enqueued("refund.issued")
            assert [e.payload["total"] for e in outbox_drain.enqueued("order.placed")] == [10, 20]
            with pytest.raises(AssertionError, match="expected 1 'order.placed'"):
                outbox_drain.assert_enqueued("order.placed", count=1)
            with pytest.raises(AssertionError, match="expected no 'order.placed' event"):
                outbox_drain.refute_enqueued("order.placed", {"total": 20})

        def test_capture(outbox, outbox_drain):
            enqueue(outbox, "order.placed", {"order_id": 1})
            with outbox_drain.capture() as cap:
                enqueue(outbox, "order.placed", {"order_id": 2})
            enqueue(outbox, "order.placed", {"order_id": 3})
            assert [e.payload["order_id"] for e in cap.enqueued("order.placed")] == [2]
            cap.assert_enqueued("order.placed", {"order_id": 2}, count=1)
            cap.refute_enqueued("order.placed", {"order_id": 1})
        """,
    )
    result.assert_outcomes(passed=2)


def test_deliver_one_runs_a_single_handler(app: pytest.Pytester) -> None:
    result = run(
        app,
        """
        from apphelpers import enqueue

        def test_one(outbox, outbox_drain):
            waiting = enqueue(outbox, "order.placed", {"order_id": 7})
            report = outbox_drain.deliver_one("reserve-stock", {"order_id": 8})
            assert [(d.handler, d.outcome.value) for d in report.deliveries] == [
                ("reserve-stock", "succeeded")
            ]
            outbox_drain.assert_enqueued("stock.reserved", {"order_id": 8}, count=1)
            # the event already waiting was not touched: no attempt used, still due
            event = outbox.store.get(waiting)
            assert event.attempts == 0 and event.published_at is None
            everything = outbox_drain()
            everything.assert_delivered("order.placed", handler="fraud-check", count=1)
        """,
    )
    result.assert_outcomes(passed=1)


def test_app_outbox_is_rebound_without_touching_the_original(app: pytest.Pytester) -> None:
    result = run(
        app,
        """
        import myapp

        def test_rebound(outbox, outbox_store, outbox_clock):
            assert type(outbox_store).__name__ == "{store_class}"
            assert outbox is not myapp.outbox
            assert outbox.store is outbox_store
            assert outbox.clock is outbox_clock
            assert outbox.bus is myapp.bus
            assert myapp.outbox.store is not outbox_store
            assert type(myapp.outbox.clock).__name__ == "SystemClock"
        """.replace("{store_class}", STORE_CLASS[id(app)]),
    )
    result.assert_outcomes(passed=1)


def test_clock_marker_and_freezegun_tie(app: pytest.Pytester) -> None:
    result = run(
        app,
        """
        import time
        from datetime import datetime, timezone
        import pytest
        from outboxkit import Event
        from apphelpers import enqueue
        import myapp

        def test_default_start(outbox_clock):
            assert outbox_clock.now().isoformat() == "2030-01-01T00:00:00+00:00"

        @pytest.mark.outbox(now="2031-05-06T07:08:09Z")
        def test_marker(outbox_clock):
            assert outbox_clock.now() == datetime(2031, 5, 6, 7, 8, 9, tzinfo=timezone.utc)
            outbox_clock.advance(1.5)
            assert outbox_clock.now().microsecond == 500000

        @pytest.mark.outbox(now="2031-05-06T07:08:09Z", freezegun=True)
        def test_freezegun(outbox, outbox_drain, outbox_clock):
            seen = []

            def stamp(event, ctx):
                seen.append((datetime.now(timezone.utc), outbox_clock.now(), time.time()))
                if ctx.attempt < 4:
                    raise ConnectionError("not yet")

            outbox.bus.subscribe("stamp", stamp, name="stamp")
            enqueue(outbox, "stamp", {})
            with outbox_drain.expect_failures("stamp"):
                report = outbox_drain()
            assert len(seen) == 4
            for app_now, clock_now, wall in seen:
                assert app_now == clock_now
                assert wall == clock_now.timestamp()
            assert [d.at for d in report.deliveries] == [c for _, c, _ in seen]
            # moving freezegun's time moves the outbox clock too, and the other way round
            before = outbox_clock.now()
            outbox_clock.freezer.tick(5)
            assert outbox_clock.now() == datetime.now(timezone.utc)
            assert (outbox_clock.now() - before).total_seconds() == 5
            outbox_clock.advance(10)
            assert datetime.now(timezone.utc) == outbox_clock.now()
            assert (datetime.now(timezone.utc) - before).total_seconds() == 15
        """,
    )
    result.assert_outcomes(passed=3)


def test_strict_mode_fails_on_unaccounted_events(app: pytest.Pytester) -> None:
    app.makeini(
        """
        [pytest]
        outboxkit_app = myapp:outbox
        outboxkit_strict = true
        """
    )
    result = run(
        app,
        """
        from apphelpers import enqueue

        def test_forgotten(outbox, outbox_drain):
            enqueue(outbox, "refund.issued", {"amount": 5})

        def test_asserted(outbox, outbox_drain):
            enqueue(outbox, "refund.issued", {"amount": 5})
            outbox_drain.assert_enqueued("refund.issued")

        def test_drained(outbox, outbox_drain):
            enqueue(outbox, "stock.reserved", {"order_id": 1})
            outbox_drain()
        """,
    )
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*outboxkit_strict: 1 enqueued event(s) were neither drained nor asserted*",
            "*'refund.issued': {'amount': 5}*",
        ]
    )


def test_ini_options_freezegun_store_and_a_fresh_outbox(pytester: pytest.Pytester) -> None:
    pytester.makeini(
        """
        [pytest]
        outboxkit_store = memory://
        outboxkit_freezegun = true
        """
    )
    pytester.makepyfile(
        test_ini="""
        from datetime import datetime, timezone

        def test_fresh(outbox, outbox_store, outbox_clock, outbox_drain):
            assert type(outbox_store).__name__ == "MemoryStore"
            assert outbox.bus.topics == ()
            assert datetime.now(timezone.utc) == outbox_clock.now()
            outbox_clock.set("2032-02-03T04:05:06Z")
            assert datetime.now(timezone.utc).isoformat() == "2032-02-03T04:05:06+00:00"
            with outbox_store.transaction() as tx:
                outbox.enqueue(tx, "nobody.listens", {})
            report = outbox_drain()
            assert len(report.published) == 1
        """
    )
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


@pytest.mark.pg
def test_postgres_schema_per_test_under_xdist(pytester: pytest.Pytester) -> None:
    pytest.importorskip("xdist")
    url = pg_test_url(pg_url_from_env())
    require_server(pg_url_from_env())
    pytester.makepyfile(
        test_many="""
        import pytest

        @pytest.mark.parametrize("n", range(6))
        def test_isolated(outbox, outbox_store, outbox_drain, n):
            assert outbox_store.stats(now=None).total == 0   # nothing from other tests
            assert outbox_store.names.schema.startswith("outboxkit_test_gw")
            with outbox_store.transaction() as conn:
                outbox.enqueue(conn, "t", {"n": n})
            assert len(outbox_drain().published) == 1
        """
    )
    result = pytester.runpytest_subprocess(
        "-q", "-p", "no:cacheprovider", "-n", "2", f"--outbox-store={url}"
    )
    result.assert_outcomes(passed=6)
    with psycopg.connect(pg_url_from_env(), autocommit=True) as conn:
        left = conn.execute(
            "SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'outboxkit_test_gw%'"
        ).fetchone()
    assert left == (0,)
