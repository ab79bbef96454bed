"""A per-event round on PostgreSQL (``PostgresStore.deliveries``): one connection for the
round, the records of deliveries that never opened their transaction sent pipelined, read
back before anything else uses the connection. What must hold: every record answered before
its event is settled; a refused record is a lost lease; a failed one, or a connection lost with
records unanswered, ends the round without settling anything it could not confirm."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outboxkit import (
    ConfigurationError,
    Event,
    EventBus,
    FrozenClock,
    Outbox,
    StoreError,
    StoreUnavailable,
)
from outboxkit.core.model import Outcome
from outboxkit.core.payload import build_event
from outboxkit.storekit.rows import record_params
from outboxkit_pg import PostgresStore
from outboxkit_pg.delivery import Round
from outboxkit_pg.pipeline import RecordPipeline, drain

from .conftest import migrated_store
from .test_delivery_budget import traced

pytestmark = pytest.mark.pg


def _enqueue(store: PostgresStore, n: int, topic: str = "t") -> list[int]:
    with store.transaction() as conn:
        return store.enqueue(conn, [build_event(topic, {"n": i}) for i in range(n)], now=None)


def _records(admin: psycopg.Connection[Any], store: PostgresStore) -> list[tuple[int, str]]:
    table = sql.Identifier(store.names.schema, store.names.deliveries)
    query = sql.SQL("SELECT event_id, handler FROM {} ORDER BY event_id, handler").format(table)
    return [(int(r[0]), str(r[1])) for r in admin.execute(query)]


def _pipelined(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the records sent pipelined (by event id)."""
    sent: list[int] = []
    original = RecordPipeline.send

    def send(self: RecordPipeline, claim: Any, params: Any) -> None:
        sent.append(claim.event.id)
        original(self, claim, params)

    monkeypatch.setattr(RecordPipeline, "send", send)
    return sent


@pytest.mark.parametrize("transactional", [True, False])
def test_a_round_pipelines_the_records_and_settles_after_reading_them(
    pg_store: PostgresStore,
    admin: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
    transactional: bool,
) -> None:
    sent = _pipelined(monkeypatch)
    takes: list[int] = []
    original = pg_store.dialect.pool.connection

    def counted(doing: str) -> Any:
        takes.append(1)
        return original(doing)

    monkeypatch.setattr(pg_store.dialect.pool, "connection", counted)
    bus = EventBus()
    bus.subscribe("t", lambda e, ctx: None, name="h", transactional=transactional)
    ids = _enqueue(pg_store, 20)
    takes.clear()
    report = Outbox(pg_store, bus, load_entry_points=False).poller(batch_size=20).run_once()
    assert sorted(report.published) == ids
    assert sent == ids  # every record pipelined, in claim order
    assert _records(admin, pg_store) == [(i, "h") for i in ids]
    assert len(takes) == 2  # the claim's connection, and the round's for 20 deliveries


@pytest.mark.parametrize(("pool_max_size", "lines"), [(5, 3), (4, 2)])
def test_concurrency_commits_the_records_on_that_many_connections(
    pg_url: str,
    admin: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    pool_max_size: int,
    lines: int,
) -> None:
    """Up to ``concurrency`` connections, held to the pool's size less the two the claims
    keep (said once in the log)."""
    backends: dict[int, list[int]] = {}
    original = RecordPipeline.send

    def send(self: RecordPipeline, claim: Any, params: Any) -> None:
        backends.setdefault(self.pgconn.backend_pid, []).append(claim.event.id)
        original(self, claim, params)

    monkeypatch.setattr(RecordPipeline, "send", send)
    bus = EventBus()
    bus.subscribe("t", lambda e, ctx: None, name="h", transactional=False)
    with migrated_store(pg_url, notify=False, pool_max_size=pool_max_size) as store:
        ids = _enqueue(store, 30)
        outbox = Outbox(store, bus, load_entry_points=False)
        poller = outbox.poller(batch_size=30, concurrency=3)
        assert "concurrency=3" in repr(poller)
        with caplog.at_level(logging.INFO, logger="outboxkit"):
            report = poller.run_once()
        assert sorted(report.published) == ids
        assert sorted(len(sent) for sent in backends.values()) == [30 // lines] * lines
        assert sorted(i for sent in backends.values() for i in sent) == ids
        assert _records(admin, store) == [(i, "h") for i in ids]
        held = [r.message for r in caplog.records if "held to" in r.message]
        assert held == ([] if lines == 3 else [held[0]])
        if held:
            assert "concurrency 3 held to 2 connection(s)" in held[0]
            assert "pool_max_size is 4" in held[0]


def test_concurrency_is_refused_with_per_batch_and_out_of_range(pg_store: PostgresStore) -> None:
    outbox = Outbox(pg_store, EventBus(), load_entry_points=False)
    with pytest.raises(ConfigurationError, match="concurrency=2"):
        outbox.poller(transaction="per_batch", concurrency=2)
    for bad in (0, 1001, True, 1.5):
        with pytest.raises(ConfigurationError, match="concurrency must be an integer"):
            outbox.poller(concurrency=bad)


def test_a_record_the_token_refuses_is_a_lost_lease_and_nothing_is_settled(
    pg_store: PostgresStore, admin: psycopg.Connection[Any]
) -> None:
    events = sql.Identifier(pg_store.names.schema, pg_store.names.events)
    bus = EventBus()

    @bus.handler("t", name="h", transactional=False)
    def taken_over(event: Event, ctx: Any) -> None:
        if event.payload["n"] == 1:  # another poller takes the lease over meanwhile
            admin.execute(
                sql.SQL("UPDATE {} SET claim_token = gen_random_uuid() WHERE id = %s").format(
                    events
                ),
                (event.id,),
            )

    ids = _enqueue(pg_store, 3)
    report = Outbox(pg_store, bus, load_entry_points=False).poller().run_once()
    assert sorted(report.published) == [ids[0], ids[2]]
    assert report.lease_lost == [ids[1]]
    assert _records(admin, pg_store) == [(ids[0], "h"), (ids[2], "h")]
    (stolen,) = [e for e in pg_store.events() if e.id == ids[1]]
    assert stolen.published_at is None


def test_a_failed_record_ends_the_round_without_settling_and_recovers_by_the_lease(
    pg_url: str, admin: psycopg.Connection[Any]
) -> None:
    clock = FrozenClock()
    with migrated_store(pg_url, notify=False) as store:
        runs: list[int] = []
        bus = EventBus()

        @bus.handler("t", name="h", transactional=False)
        def handler(event: Event, ctx: Any) -> None:
            runs.append(event.payload["n"])
            if event.payload["n"] == 1:  # a record of h appears meanwhile: the pipelined
                deliveries = sql.Identifier(store.names.schema, store.names.deliveries)
                admin.execute(  # insert fails on the primary key
                    sql.SQL(
                        "INSERT INTO {} (event_id, handler, outcome, attempt, recorded_at)"
                        " VALUES (%s, 'h', 'succeeded', 1, now())"
                    ).format(deliveries),
                    (event.id,),
                )

        ids = _enqueue(store, 3)
        outbox = Outbox(store, bus, clock=clock, load_entry_points=False)
        poller = outbox.poller(lease=30)
        with pytest.raises(StoreError, match=f"event {ids[1]} already has a delivery record"):
            poller.run_once()
        assert store.stats(now=clock.now()).published == 0  # nothing settled
        clock.advance(timedelta(seconds=31))  # the leases run out
        report = poller.run_once()
        assert sorted(report.published) == ids
        assert runs == [0, 1, 2]  # each recorded once: none runs again
        assert _records(admin, store) == [(i, "h") for i in ids]


def test_a_connection_lost_with_records_unanswered_settles_nothing(
    pg_url: str, admin: psycopg.Connection[Any]
) -> None:
    clock = FrozenClock()
    with migrated_store(pg_url, notify=False) as store:
        runs: list[int] = []
        pid: list[int] = []
        bus = EventBus()

        @bus.handler("t", name="h")
        def handler(event: Event, ctx: Any) -> None:
            n = event.payload["n"]
            runs.append(n)
            if n == 0:  # opens the round's connection's transaction: its backend
                pid.append(ctx.connection.execute("SELECT pg_backend_pid()").fetchone()[0])
            if n == 3:  # the server ends the round's connection: 1 and 2 may be unanswered
                admin.execute("SELECT pg_terminate_backend(%s)", (pid[0],))

        ids = _enqueue(store, 5)
        poller = Outbox(store, bus, clock=clock, load_entry_points=False).poller(lease=30)
        with pytest.raises(StoreUnavailable):
            poller.run_once()
        assert store.stats(now=clock.now()).published == 0  # nothing settled past the loss
        recorded = {event_id for event_id, _ in _records(admin, store)}
        first = list(runs)
        assert first[:4] == [0, 1, 2, 3]
        assert {ids[n] for n in first} >= recorded
        clock.advance(timedelta(seconds=31))
        report = poller.run_once()
        assert sorted(report.published) == ids
        assert _records(admin, store) == [(i, "h") for i in ids]  # one record each
        # Run again: exactly the events whose record had not committed before the loss.
        assert runs[len(first) :] == [n for n, i in enumerate(ids) if i not in recorded]


def test_a_handler_using_the_connection_and_a_rollback_between_pipelined_records(
    pg_store: PostgresStore, admin: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transactional handler that writes drains the pipeline first; a failing one rolls
    back, after which psycopg deallocates every prepared statement: the next pipelined record
    prepares its statement again."""
    sent = _pipelined(monkeypatch)
    ledger = sql.Identifier(pg_store.names.schema, "ledger")
    admin.execute(sql.SQL("CREATE TABLE {} (n bigint)").format(ledger))
    bus = EventBus()

    @bus.handler("t", name="h")
    def handler(event: Event, ctx: Any) -> None:
        n = event.payload["n"]
        if n % 3 == 1:
            ctx.connection.execute(sql.SQL("INSERT INTO {} VALUES (%s)").format(ledger), (n,))
        if n % 3 == 2:
            ctx.connection.execute("SELECT 1")
            raise RuntimeError("rolled back")

    ids = _enqueue(pg_store, 9)
    report = Outbox(pg_store, bus, load_entry_points=False).poller().run_once()
    assert sorted(report.published) == [ids[n] for n in range(9) if n % 3 != 2]
    assert sorted(report.retried) == [ids[n] for n in range(9) if n % 3 == 2]
    assert sent == [ids[n] for n in range(9) if n % 3 == 0]
    assert [r[0] for r in admin.execute(sql.SQL("SELECT n FROM {} ORDER BY n").format(ledger))] == [
        1,
        4,
        7,
    ]


def test_without_prepared_statements_a_round_waits_for_each_record(
    pg_url: str, admin: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    sent = _pipelined(monkeypatch)
    with migrated_store(pg_url, notify=False, prepare_threshold=None) as store:
        bus = EventBus()
        bus.subscribe("t", lambda e, ctx: None, name="h", transactional=False)
        ids = _enqueue(store, 5)
        report = Outbox(store, bus, load_entry_points=False).poller().run_once()
        assert sorted(report.published) == ids
        assert sent == []
        assert _records(admin, store) == [(i, "h") for i in ids]


def test_the_round_is_what_the_poller_delivers_through(pg_store: PostgresStore) -> None:
    with pg_store.rounds() as deliveries:
        assert isinstance(deliveries, Round)


def test_the_rounds_old_name_still_opens_one_with_a_deprecation_warning(
    pg_store: PostgresStore,
) -> None:
    with (
        pytest.warns(DeprecationWarning, match=r"deliveries\(\) is deprecated: use .*rounds\(\)"),
        pg_store.deliveries(concurrency=2) as deliveries,
    ):
        assert isinstance(deliveries, Round)


def _record_parses_and_errors(trace: str) -> tuple[int, list[str]]:
    """How often the frontend prepared the record statement, and the SQLSTATEs of the errors
    the server answered with, in a libpq trace."""
    parses = sum(
        1 for line in trace.splitlines() if "\tParse\t" in line and '"outboxkit_record_' in line
    )
    errors = [
        line.split('C "', 1)[1][:5]
        for line in trace.splitlines()
        if "\tErrorResponse\t" in line and 'C "' in line
    ]
    return parses, errors


def test_a_connection_prepares_the_record_statement_once_over_many_rounds(pg_url: str) -> None:
    """The record statement is prepared at a connection's first round only: a later round
    sends no prepare the server would refuse (an error in its log, a parse wasted)."""
    text: list[str] = []
    with traced(text), migrated_store(pg_url, notify=False, pool_max_size=2) as store:
        bus = EventBus()
        bus.subscribe("t", lambda e, ctx: None, name="h", transactional=False)
        poller = Outbox(store, bus, load_entry_points=False).poller(batch_size=2)
        published = []
        for _ in range(5):
            ids = _enqueue(store, 2)
            report = poller.run_once()
            assert sorted(report.published) == ids
            published += ids
        with store.transaction() as conn:
            assert _records(conn, store) == [(i, "h") for i in published]
    parses, errors = _record_parses_and_errors(text[0])
    assert errors == []
    assert 1 <= parses <= 2  # once per connection of the pool that carried a round


def test_a_record_whose_prepared_statement_a_handler_dropped_is_sent_again(
    pg_url: str,
) -> None:
    """A handler drops every prepared statement of the round's connection: the next record
    fails in its own sync (writing nothing) and is sent again behind a new prepare; every
    event is published once, recorded once, none retried."""
    text: list[str] = []
    with traced(text), migrated_store(pg_url, notify=False, pool_max_size=1) as store:
        bus = EventBus()
        bus.subscribe("t", lambda e, ctx: None, name="h", transactional=False)
        bus.subscribe(
            "drop", lambda e, ctx: ctx.connection.execute("DEALLOCATE ALL"), name="dropper"
        )
        outbox = Outbox(store, bus, load_entry_points=False)
        first = _enqueue(store, 2)
        assert sorted(outbox.poller(batch_size=2).run_once().published) == first
        ids = _enqueue(store, 1, topic="drop") + _enqueue(store, 2)
        report = outbox.poller(batch_size=3).run_once()
        assert sorted(report.published) == ids
        assert report.retried == [] and report.dead_lettered == []
        with store.transaction() as conn:
            records = _records(conn, store)
        assert records == sorted([(i, "h") for i in [*first, *ids[1:]]] + [(ids[0], "dropper")])
    parses, errors = _record_parses_and_errors(text[0])
    # the first record after the drop, and the second if it was sent before the first's
    # answer came; prepared again once (no prepare the server refuses as a duplicate)
    assert errors in (["26000"], ["26000", "26000"])
    assert parses == 2


def test_records_in_flight_when_their_statement_was_dropped_prepare_it_again_once(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two records sent before either answer is read, after the statement was dropped: both
    fail (writing nothing), the first is sent again behind one new prepare, the second behind
    that same prepare; no prepare the server refuses as a duplicate, both records written."""
    text: list[str] = []
    with traced(text), migrated_store(pg_url, notify=False, pool_max_size=1) as store:
        ids = _enqueue(store, 3)
        claims = store.claim(batch_size=3, lease=timedelta(seconds=30), now=None)
        with store.dialect.connection("test") as conn:
            first = RecordPipeline(store.dialect, conn)
            first.send(claims[0], record_params(claims[0], "h", Outcome.SUCCEEDED, None, None))
            drain(first)  # the statement prepared, and known to be
            conn.execute("DEALLOCATE ALL")
            pipeline = RecordPipeline(store.dialect, conn)
            monkeypatch.setattr(pipeline, "take_results", lambda: None)  # read nothing yet
            for claim in claims[1:]:
                pipeline.send(claim, record_params(claim, "h", Outcome.SUCCEEDED, None, None))
            monkeypatch.undo()
            drain(pipeline)
            assert pipeline.refused == set()
        with store.transaction() as tx:
            assert _records(tx, store) == [(i, "h") for i in ids]
    parses, errors = _record_parses_and_errors(text[0])
    assert errors == ["26000", "26000"]
    assert parses == 2  # the first record's, and once again after the drop
