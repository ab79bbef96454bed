"""The drain aimed: ``topics=``, ``handlers=``, ``limit=``, ``advance_time=False``, and
``report.left`` saying what was left and why. On memory, SQLite and PostgreSQL."""

from __future__ import annotations

import pytest

from tests.plugin.sample import run


def test_topics_handlers_and_limit(any_app: pytest.Pytester) -> None:
    result = run(
        any_app,
        """
        import pytest
        from outboxkit import ConfigurationError
        from apphelpers import enqueue

        def test_topics(outbox, outbox_drain):
            enqueue(outbox, "order.placed", {"order_id": 1})
            enqueue(outbox, "payment.captured", {"fail_times": 0})
            report = outbox_drain(topics=["payment.captured"])
            report.assert_delivered("payment.captured", handler="flaky-ledger")
            assert report.deliveries_to(topic="order.placed") == []
            (left,) = report.left
            assert left.event.topic == "order.placed"
            assert "topics=['payment.captured']" in left.reason
            assert "left: event 1 'order.placed': not aimed at" in report.summary()
            # the rest, later: the follow-up too
            outbox_drain().assert_delivered("stock.reserved", handler="notify-warehouse")

        def test_handlers(outbox, outbox_drain):
            enqueue(outbox, "order.placed", {"order_id": 1})
            enqueue(outbox, "email.requested", {"to": "a@example.com"})
            report = outbox_drain(handlers=["fraud-check"])
            # the event's other handler ran too: an event is published once all have run
            report.assert_delivered("order.placed", handler="fraud-check")
            report.assert_delivered("order.placed", handler="reserve-stock")
            assert {l.event.topic for l in report.left} == {"email.requested", "stock.reserved"}
            with pytest.raises(ConfigurationError, match="no-such"):
                outbox_drain(handlers=["no-such"])

        def test_limit(outbox, outbox_drain):
            for n in range(3):
                enqueue(outbox, "payment.captured", {"fail_times": 0, "n": n})
            report = outbox_drain(limit=2)
            assert [d.event_id for d in report.deliveries] == [1, 2]
            assert [(l.event.id, l.reason) for l in report.left] == [(3, "limit=2 reached")]
            assert len(outbox_drain().published) == 1
        """,
    )
    result.assert_outcomes(passed=3)


def test_advance_time_false_leaves_the_retry_scheduled(any_app: pytest.Pytester) -> None:
    result = run(
        any_app,
        """
        from datetime import timedelta
        from apphelpers import enqueue

        def test_retry_left(outbox, outbox_drain, outbox_clock):
            start = outbox_clock.now()
            enqueue(outbox, "payment.captured", {"fail_times": 1})
            enqueue(outbox, "order.placed", {"order_id": 1}, delay=timedelta(hours=1))
            report = outbox_drain(advance_time=False, raise_errors=False)
            assert outbox_clock.now() == start and report.advanced == timedelta(0)
            assert [d.outcome.value for d in report.deliveries] == ["failed"]
            retry, scheduled = report.left
            assert retry.event.topic == "payment.captured"
            assert retry.reason.startswith("retry (attempt 2) due at 2030-01-01 00:00:01")
            assert "ledger down" in retry.reason and "advance_time=False" in retry.reason
            assert scheduled.reason == "scheduled at 2030-01-01 01:00:00+00:00: advance_time=False"
            outbox_drain.assert_enqueued("payment.captured", scheduled=timedelta(seconds=1))
            # and then on: the retry succeeds at its time; the scheduled one stays
            report = outbox_drain()
            report.assert_delivered("payment.captured")
            assert [l.event.topic for l in report.left] == ["order.placed"]
            assert "past the drain's reach (no until=)" in report.left[0].reason
        """,
    )
    result.assert_outcomes(passed=1)


def test_fail_fast_names_handler_event_and_error_first(any_app: pytest.Pytester) -> None:
    result = run(
        any_app,
        """
        import pytest
        from outboxkit.testing import HandlerErrors
        from apphelpers import enqueue

        def test_fail_fast(outbox, outbox_drain):
            enqueue(outbox, "email.requested", {"to": "a@example.com"})
            with pytest.raises(HandlerErrors) as caught:
                outbox_drain(fail_fast=True)
            first = str(caught.value).splitlines()[0]
            assert first.startswith(
                "handler 'broken-mailer' failed on event 1 'email.requested' (attempt 1): "
                "RuntimeError: smtp exploded (fail_fast"
            )
            assert len(caught.value.exceptions) == 1
            assert len(caught.value.report.deliveries) == 1

        def test_without_fail_fast_the_first_line_names_the_first_failure(outbox, outbox_drain):
            enqueue(outbox, "email.requested", {"to": "a@example.com"})
            with pytest.raises(HandlerErrors) as caught:
                outbox_drain()
            first = str(caught.value).splitlines()[0]
            assert first.startswith(
                "handler 'broken-mailer' failed on event 1 'email.requested' (attempt 1): "
                "RuntimeError: smtp exploded; 11 unexpected failure(s) in all"
            )
        """,
    )
    result.assert_outcomes(passed=2)
