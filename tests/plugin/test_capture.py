"""``outboxkit.testing.capture``: the enqueue assertions, on the drain and on a ``Capture``."""

from __future__ import annotations

import pytest

from tests.plugin.sample import run


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
