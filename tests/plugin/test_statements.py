"""``with outbox_drain.statements() as s:``: statements per delivery and per handler, catching a
handler that adds a query. On SQLite and PostgreSQL (the memory store runs no SQL)."""

from __future__ import annotations

import pytest

from tests.plugin.sample import run

STATEMENTS_TEST = """
import pytest
from outboxkit import EventBus, Outbox

bus = EventBus()
QUERY = {query!r}


@bus.handler("order.placed", name="record-order")
def record_order(event, ctx):
    ctx.connection.execute("SELECT 1")
    {extra}


@pytest.fixture
def outbox(outbox_store, outbox_clock):
    return Outbox(outbox_store, bus, clock=outbox_clock)


def test_cost_is_pinned(outbox, outbox_drain):
    with outbox.store.transaction() as conn:
        for n in range(3):
            outbox.enqueue(conn, "order.placed", {{"n": n}})
    with outbox_drain.statements() as s:
        outbox_drain()
    assert s.deliveries == 3
    assert s.runs == {{"record-order": 3}}
    # pinned: its transaction's opening (2 statements) and its one query
    s.assert_at_most(**{{"record-order": 3}})
"""


@pytest.mark.parametrize(
    ("extra", "outcome"),
    [("pass", "passed"), ('ctx.connection.execute("SELECT 2")  # the added query', "failed")],
)
def test_the_statement_count_catches_an_added_query(
    app: pytest.Pytester, extra: str, outcome: str
) -> None:
    result = run(app, STATEMENTS_TEST.format(query="", extra=extra))
    result.assert_outcomes(**{outcome: 1})
    if outcome == "failed":
        assert "handler 'record-order' ran 12 statement(s) in 3 run(s): 4 per run, " in (
            result.stdout.str()
        )


def test_statements_per_delivery(app: pytest.Pytester) -> None:
    result = run(
        app,
        """
        from apphelpers import enqueue

        def test_per_delivery(outbox, outbox_drain):
            enqueue(outbox, "stock.reserved", {"order_id": 1})
            with outbox_drain.statements() as one:
                outbox_drain()
            for n in range(10):
                enqueue(outbox, "stock.reserved", {"order_id": n})
            with outbox_drain.statements() as ten:
                outbox_drain()
            assert one.applies and one.deliveries == 1 and ten.deliveries == 10
            assert 0 < ten.per_delivery <= one.per_delivery
            print("statements per delivery:", one.per_delivery, ten.per_delivery)
            ten.assert_at_most(per_delivery=one.per_delivery)
        """,
        "-s",
    )
    result.assert_outcomes(passed=1)


def test_memory_store_counts_nothing(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_memory="""
        def test_memory(outbox_drain):
            with outbox_drain.statements() as s:
                outbox_drain()
            assert not s.applies and s.statements == 0 and s.per_delivery == 0
        """
    )
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    result = pytester.runpytest_inprocess(
        "-q", "-p", "no:cacheprovider", "--outbox-store=memory://"
    )
    result.assert_outcomes(passed=1)


def test_a_statement_of_another_thread_is_not_counted() -> None:
    # A connection pool opens connections (and sets their sessions up) in threads of its own,
    # at moments of its own: counted, they would make a handler's pinned cost flaky.
    import threading

    from outboxkit.testing.statements import StatementCount

    count = StatementCount(thread=threading.get_ident())
    count.current = "record-order"
    count.note()
    other = threading.Thread(target=count.note)
    other.start()
    other.join(30)
    assert (count.statements, count.by_handler) == (1, {"record-order": 1})
