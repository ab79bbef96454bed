"""The pytest plugin, tested the way users meet it: a sample app and its tests, run by pytester."""

from __future__ import annotations

import pytest

from tests.plugin.sample import SAMPLE_APP, STORE_CLASS, run


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


def test_strict_mode_fails_on_unaccounted_events(app: pytest.Pytester) -> None:
    app.makeini(
        """
        [pytest]
        asyncio_default_fixture_loop_scope = function
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
        asyncio_default_fixture_loop_scope = function
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


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("myapp", "*outboxkit_app must be module:attribute*got 'myapp'*"),
        ("nowhere:outbox", "*cannot import 'nowhere' for outboxkit_app 'nowhere:outbox'*"),
        ("myapp:missing", "*outboxkit_app 'myapp:missing': 'myapp' has no attribute 'missing'*"),
        ("myapp:bus", "*outboxkit_app 'myapp:bus' is an EventBus, not an outboxkit.Outbox*"),
    ],
)
def test_an_app_that_cannot_be_loaded_is_a_usage_error(
    pytester: pytest.Pytester, spec: str, message: str
) -> None:
    pytester.makepyfile(myapp=SAMPLE_APP)
    pytester.syspathinsert()
    pytester.makeini(
        f"[pytest]\nasyncio_default_fixture_loop_scope = function\noutboxkit_app = {spec}\n"
    )
    pytester.makepyfile(test_app="def test_app(outbox):\n    pass\n")
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*UsageError*", message])
