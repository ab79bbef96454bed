"""``outboxkit.testing.matching`` through the assertions: nested partial payloads, wildcards,
key, headers and scheduled-time matchers; outboxkit's frames hidden from a failed assertion's
traceback. On memory, SQLite and PostgreSQL."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest

from outboxkit.testing import ANY, Matcher
from outboxkit.testing.matching import first_mismatch
from tests.plugin.sample import run

PAYLOAD = {"order": {"id": 42, "lines": [{"sku": "A", "qty": 2}], "note": None}, "total": 30}


@pytest.mark.parametrize(
    ("pattern", "where"),
    [
        ({"order": {"id": 42}}, None),
        ({"order": {"id": 41}}, "payload.order.id: 42 != 41"),
        ({"order": {"lines": [{"sku": "A"}]}}, None),
        ({"order": {"lines": [ANY, ANY]}}, "payload.order.lines: 1 item(s), expected 2"),
        ({"order": {"lines": [{"qty": int}]}}, None),
        ({"total": str}, "payload.total: 30 is not a str"),
        ({"order": {"note": ANY}}, None),
        ({"order": {"missing": ANY}}, "payload.order: no key 'missing'"),
        ({"order": {"lines": [{"sku": re.compile("[A-Z]")}]}}, None),
        ({"total": Matcher(lambda v: v > 100, "over 100")}, "payload.total: 30 is not <over 100>"),
        ({"total": True}, "payload.total: 30 != True"),
    ],
)
def test_first_mismatch_table(pattern: object, where: str | None) -> None:
    assert first_mismatch(PAYLOAD, pattern) == where


def test_assertions_match_nested_payloads_keys_headers_and_times(any_app: pytest.Pytester) -> None:
    result = run(
        any_app,
        """
        import re
        from datetime import timedelta
        import pytest
        from outboxkit.testing import ANY, Matcher
        from apphelpers import enqueue

        def test_matchers(outbox, outbox_drain, outbox_clock):
            enqueue(
                outbox, "order.placed",
                {"order": {"id": 42, "lines": [{"sku": "A", "qty": 2}]}, "total": 30},
                key="order-42", headers={"tenant": "acme", "trace": "t1"},
                delay=timedelta(minutes=5),
            )
            drain = outbox_drain
            drain.assert_enqueued("order.placed", {"order": {"lines": [{"sku": "A"}]}})
            drain.assert_enqueued("order.placed", {"order": {"id": int, "lines": ANY}})
            drain.assert_enqueued("order.placed", key="order-42", headers={"tenant": "acme"})
            drain.assert_enqueued("order.placed", key=re.compile(r"order-\\d+"))
            drain.assert_enqueued("order.placed", scheduled=timedelta(minutes=5))
            drain.assert_enqueued(
                "order.placed", scheduled=Matcher(lambda at: at > outbox_clock.now(), "later")
            )
            drain.refute_enqueued("order.placed", key=None)
            drain.refute_enqueued("order.placed", headers={"tenant": "other"})
            with pytest.raises(AssertionError) as caught:
                drain.assert_enqueued("order.placed", {"order": {"lines": [{"qty": 3}]}})
            message = str(caught.value)
            assert "<- payload.order.lines[0].qty: 2 != 3" in message
        """,
    )
    result.assert_outcomes(passed=1)


def test_a_failed_assertion_shows_no_outboxkit_frames(any_app: pytest.Pytester) -> None:
    result = run(
        any_app,
        """
        def test_fails(outbox_drain):
            outbox_drain.assert_enqueued("order.placed", {"order_id": 1})
        """,
    )
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "expected at least one 'order.placed' event(s)" in text
    assert "outboxkit/testing" not in text
    assert text.count("def ") <= 2  # the test's own frame only


def test_matcher_and_any_reprs() -> None:
    assert repr(ANY) == "ANY"
    assert repr(Matcher(bool, "truthy")) == "<truthy>"
    assert first_mismatch(datetime(2030, 1, 1, tzinfo=UTC), ANY) is None
