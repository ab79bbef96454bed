"""``outboxkit.testing.report``: ``DrainReport``'s assertions and summary, ``HandlerErrors``."""

from __future__ import annotations

import pytest

from tests.plugin.sample import run


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


def test_the_key_order_and_duplicate_checks_pass_a_real_drain_and_name_what_breaks_them(
    any_app: pytest.Pytester,
) -> None:
    result = run(
        any_app,
        """
        import dataclasses
        import pytest
        from apphelpers import enqueue

        def test_checks(outbox, outbox_drain):
            enqueue(outbox, "stock.reserved", {"order_id": 1}, key="order-1")
            enqueue(outbox, "stock.reserved", {"order_id": 1}, key="order-1")
            report = outbox_drain()
            report.assert_key_order()
            report.assert_no_duplicates()
            # The same drain, its deliveries out of order or one of them twice:
            swapped = dataclasses.replace(report, deliveries=report.deliveries[::-1])
            with pytest.raises(AssertionError, match="key 'order-1': event 1 was delivered after event 2"):
                swapped.assert_key_order()
            twice = dataclasses.replace(report, deliveries=[*report.deliveries, report.deliveries[0]])
            with pytest.raises(AssertionError, match="'notify-warehouse' succeeded 2 times for event 1"):
                twice.assert_no_duplicates()
        """,
    )
    result.assert_outcomes(passed=1)
