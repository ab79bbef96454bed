"""Crash-point injection on the drain (``crash_at=``): an app whose handler is not idempotent
fails its own test under the injection, and passes once the handler is fixed. On memory,
SQLite and PostgreSQL."""

from __future__ import annotations

import pytest

from tests.plugin.sample import run

GATEWAY_APP = """
from outboxkit import EventBus, MemoryStore, Outbox

bus = EventBus()


class Gateway:
    '''A payment API: charges cards; takes an idempotency key, as real ones do.'''

    def __init__(self):
        self.charges = []
        self.keys = set()

    def charge(self, order_id, amount, idempotency_key=None):
        if idempotency_key is not None:
            if idempotency_key in self.keys:
                return
            self.keys.add(idempotency_key)
        self.charges.append((order_id, amount))


gateway = Gateway()


@bus.handler("order.placed", name="charge-card", transactional=False)
def charge_card(event, ctx):
    gateway.charge(event.payload["order_id"], event.payload["total"]{key})


outbox = Outbox(MemoryStore(), bus)
"""

BROKEN = GATEWAY_APP.replace("{key}", "")
FIXED = GATEWAY_APP.replace("{key}", ", idempotency_key=event.message_id")

APP_TESTS = """
import pytest
from outboxkit.testing import CrashAt
import myapp

@pytest.fixture(autouse=True)
def fresh_gateway():
    myapp.gateway.__init__()

def place(outbox, order_id, total):
    with outbox.store.transaction() as conn:
        outbox.enqueue(conn, "order.placed", {"order_id": order_id, "total": total})

@pytest.mark.parametrize("point", ["before_commit", "lease_lost", "stale_poller"])
def test_charged_once(outbox, outbox_drain, point):
    place(outbox, 1, 30)
    report = outbox_drain(crash_at=CrashAt(point, handler="charge-card"))
    assert report.crashes, "the crash point struck"
    assert myapp.gateway.charges == [(1, 30)]
"""


@pytest.mark.parametrize(("app_source", "outcome"), [(BROKEN, "failed"), (FIXED, "passed")])
def test_a_non_idempotent_handler_fails_its_test_under_injection(
    any_app: pytest.Pytester, app_source: str, outcome: str
) -> None:
    any_app.makepyfile(myapp=app_source)
    result = run(any_app, APP_TESTS)
    result.assert_outcomes(**{outcome: 3})
    if outcome == "failed":
        assert "assert [(1, 30), (1, 30)] == [(1, 30)]" in result.stdout.str()


def test_each_crash_point_on_the_production_path(any_app: pytest.Pytester) -> None:
    result = run(
        any_app,
        """
        from outboxkit.testing import CrashAt
        from apphelpers import enqueue

        def test_before_commit(outbox, outbox_drain, outbox_clock):
            start = outbox_clock.now()
            enqueue(outbox, "order.placed", {"order_id": 1})
            report = outbox_drain(crash_at="before_commit")
            assert report.crashes == ["injected crash before the commit of event 1"]
            # the event came back after its lease (30 s), and went through
            assert (outbox_clock.now() - start).total_seconds() == 30
            report.assert_delivered("order.placed", handler="reserve-stock")
            report.assert_no_duplicates()

        def test_after_commit(outbox, outbox_drain):
            enqueue(outbox, "order.placed", {"order_id": 1})
            report = outbox_drain(crash_at=CrashAt("after_commit", handler="reserve-stock"))
            assert report.crashes == ["injected crash after the commit of event 1"]
            # its record was committed: reserve-stock is not run again, its follow-up kept once
            assert report.deliveries_to(handler="reserve-stock") == []
            report.assert_delivered("order.placed", handler="fraud-check")
            outbox_drain.assert_enqueued("stock.reserved", count=1)
            assert 1 in report.published

        def test_lease_lost(outbox, outbox_drain):
            enqueue(outbox, "order.placed", {"order_id": 1})
            report = outbox_drain(crash_at=CrashAt("lease_lost", handler="reserve-stock"))
            outcomes = [(d.handler, d.outcome.value) for d in report.deliveries_to(handler="reserve-stock")]
            assert outcomes == [("reserve-stock", "lease_lost"), ("reserve-stock", "succeeded")]
            # the lost run's follow-up was rolled back with it
            outbox_drain.assert_enqueued("stock.reserved", count=1)

        def test_stale_poller(outbox, outbox_drain):
            enqueue(outbox, "order.placed", {"order_id": 1})
            report = outbox_drain(crash_at="stale_poller")
            assert report.crashes == ["stale poller ran event 1 again after its lease"]
            stale = report.deliveries[-1]  # the stale run: the store's fence refused it
            assert (stale.event_id, stale.outcome.value) == (1, "lease_lost")
            outbox_drain.assert_enqueued("stock.reserved", count=1)
            report.assert_no_duplicates()
        """,
    )
    result.assert_outcomes(passed=4)
