"""``outboxkit.testing.TestRelay``: an app with a relay tested without a broker; nacks,
timeouts and a lost connection for chosen events. On memory, SQLite and PostgreSQL."""

from __future__ import annotations

import pytest

from outboxkit import EventBus
from outboxkit.errors import ConfigurationError
from outboxkit.testing import TestRelay
from tests.plugin.sample import run

RELAY_APP = """
from outboxkit import EventBus, MemoryStore, Outbox
from outboxkit.relay.redis import RedisRelay

bus = EventBus()
# the app's real relay: its tests never reach this Redis
bus.relay(RedisRelay("redis://127.0.0.1:1/0"), topics=["order.*"], name="to-redis")
bus.subscribe("order.placed", lambda event, ctx: None, name="audit")
outbox = Outbox(MemoryStore(), bus, max_retries=3)
"""


def test_the_test_relay_stands_in_for_the_apps_relay(any_app: pytest.Pytester) -> None:
    any_app.makepyfile(myapp=RELAY_APP)
    result = run(
        any_app,
        """
        import json
        from outboxkit.testing import TestRelay
        from apphelpers import enqueue

        def test_published(outbox, outbox_drain):
            relay = outbox_drain.use_relay(TestRelay())
            enqueue(outbox, "order.placed", {"order_id": 1}, key="o-1")
            enqueue(outbox, "order.shipped", {"order_id": 1})
            report = outbox_drain()
            report.assert_delivered("order.placed", handler="to-redis")
            placed, shipped = relay.messages
            assert (placed.destination, json.loads(placed.body)) == ("order.placed", {"order_id": 1})
            assert placed.headers["outbox-key"] == "o-1"
            assert shipped.destination == "order.shipped"

        def test_faults(outbox, outbox_drain):
            relay = outbox_drain.use_relay(TestRelay())
            relay.nack(topic="order.placed")
            relay.time_out(topic="order.shipped")
            relay.lose_connection(topic="order.cancelled")
            for topic in ("order.placed", "order.shipped", "order.cancelled", "order.returned"):
                enqueue(outbox, topic, {})
            with outbox_drain.expect_failures("to-redis"):
                report = outbox_drain()
            failed = [(d.topic, d.error) for d in report.failed]
            assert [t for t, _ in failed] == [
                "order.placed", "order.shipped", "order.cancelled", "order.returned"
            ]
            assert "nacked" in failed[0][1] and "no confirm" in failed[1][1]
            assert "connection lost" in failed[2][1] and "connection lost" in failed[3][1]
            assert len(report.published) == 4  # all four on their retry
            # the timed-out message reached the broker twice, with one message id
            ids = relay.message_ids()
            assert len(ids) == 5 and len(set(ids)) == 4
        """,
    )
    result.assert_outcomes(passed=2)


def test_use_relay_needs_a_relay_on_the_bus() -> None:
    from outboxkit import MemoryStore, Outbox

    outbox = Outbox(MemoryStore(), EventBus(), load_entry_points=False)
    with pytest.raises(ConfigurationError, match="no relay"):
        TestRelay().bound(outbox)
    with pytest.raises(ConfigurationError, match="times must be"):
        TestRelay().nack(times=0)
