"""The partitioned layout (``partition_size``): today's tables converted in place, events and
records spread over partitions, retention dropping the finished ones, and what it refuses.

Partitions of 10 ids, so a few dozen events span several."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outboxkit import (
    ConfigurationError,
    EventBus,
    FrozenClock,
    Outbox,
    Reject,
    SchemaError,
    StoreError,
)
from outboxkit.diagnosis import Limits
from outboxkit_pg import PostgresStore, partitions
from outboxkit_pg.doctor import server_findings
from outboxkit_pg.store import SCHEMA_VERSION

from .conftest import fresh_schema

pytestmark = pytest.mark.pg

START = datetime(2026, 1, 1, tzinfo=UTC)


def _ranges(store: PostgresStore) -> list[tuple[int | None, int]]:
    with store.dialect.pool.connection("list") as conn:
        return [(p.lower, p.upper) for p in partitions.partitions(conn, store.names)]


def _tables(admin: psycopg.Connection[Any], schema: str) -> set[str]:
    rows = admin.execute(
        "SELECT tablename FROM pg_catalog.pg_tables WHERE schemaname = %s", (schema,)
    ).fetchall()
    return {r[0] for r in rows}


@pytest.fixture
def schema(pg_url: str) -> Iterator[str]:
    with fresh_schema(pg_url) as name:
        yield name


def _outbox(store: PostgresStore, bus: EventBus, clock: FrozenClock, **options: Any) -> Outbox:
    return Outbox(store, bus, clock=clock, load_entry_points=False, **options)


def _published(pg_url: str, schema: str, count: int) -> tuple[PostgresStore, Outbox, FrozenClock]:
    """A partitioned store (10 ids a partition) whose events 1 to ``count`` were published at
    START."""
    clock = FrozenClock(START)
    store = PostgresStore(pg_url, schema=schema, partition_size=10)
    store.migrate()
    outbox = _outbox(store, EventBus(), clock)
    with store.transaction() as tx:
        outbox.enqueue_many(tx, [("t", n) for n in range(1, count + 1)])
    outbox.poller(batch_size=50).run_until_idle()
    return store, outbox, clock


def test_todays_tables_are_converted_in_place_and_everything_in_them_goes_on(
    pg_url: str, schema: str, admin: psycopg.Connection[Any]
) -> None:
    clock = FrozenClock(START)
    bus = EventBus()
    seen: list[tuple[int, Any]] = []

    @bus.handler("t", name="h")
    def h(event: Any, ctx: Any) -> None:
        if event.payload == "no":
            raise Reject("no")
        seen.append((event.id, event.payload))

    plain = PostgresStore(pg_url, schema=schema)
    plain.migrate()
    outbox = _outbox(plain, bus, clock, max_retries=0)
    with plain.transaction() as tx:
        done = outbox.enqueue_many(tx, [("t", n) for n in range(5)] + [("t", "no")])
    outbox.poller().run_until_idle()
    with plain.transaction() as tx:
        waiting = [outbox.enqueue(tx, "t", f"k{n}", key="k") for n in range(3)]
    plain.close()

    store = PostgresStore(pg_url, schema=schema, partition_size=10)
    assert store.capabilities.dedupe is False
    store.migrate()
    assert store.migrate().before == SCHEMA_VERSION  # converted once; a second only checks
    assert _ranges(store) == [(None, 10), (10, 20), (20, 30), (30, 40)]
    outbox = _outbox(store, bus, clock)
    for event_id in done:  # the records came along
        assert [r.handler for r in store.records(event_id)] == ["h"]
    with store.transaction() as tx:  # ids go on from where they were, into the next ranges
        more = outbox.enqueue_many(tx, [("t", n) for n in range(10, 14)])
        keyed = outbox.enqueue(tx, "t", "k3", key="k")
    assert more[0] == waiting[-1] + 1 and keyed > 10
    outbox.poller(batch_size=3).run_until_idle()
    payloads = [p for _, p in seen]
    assert payloads[:5] == [0, 1, 2, 3, 4]
    assert [p for p in payloads if str(p).startswith("k")] == ["k0", "k1", "k2", "k3"]
    assert store.stats(now=None).published == len(done) + len(waiting) + len(more) + 1
    # The guard trigger moved to the partitioned table: every partition has its clone.
    clones = admin.execute(
        "SELECT count(*) FROM pg_catalog.pg_trigger t JOIN pg_catalog.pg_class c"
        " ON c.oid = t.tgrelid JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND t.tgname = 'outbox_events_guard'",
        (schema,),
    ).fetchone()
    assert clones == (1 + 4,)  # the partitioned table and its four partitions
    store.close()


def test_retention_drops_the_finished_partitions_and_keeps_the_others(
    pg_url: str, schema: str, admin: psycopg.Connection[Any]
) -> None:
    clock = FrozenClock(START)
    bus = EventBus()
    failing = {"dead"}

    @bus.handler("t", name="h")
    def h(event: Any, ctx: Any) -> None:
        if event.payload in failing:
            raise RuntimeError("down")

    store = PostgresStore(pg_url, schema=schema, partition_size=10)
    store.migrate()
    outbox = _outbox(store, bus, clock, max_retries=0)
    with store.transaction() as tx:  # ids 1-9: range 0; 10-19: range 1; 20-29: range 2
        outbox.enqueue_many(tx, [("t", n) for n in range(1, 20)])
        outbox.enqueue_many(tx, [("t", "dead")] + [("t", n) for n in range(21, 30)])
    outbox.poller(batch_size=50).run_until_idle()
    with store.transaction() as tx:  # range 3: one published late, one pending
        late = outbox.enqueue(tx, "t", 30)
    clock.advance(timedelta(hours=2))
    outbox.poller().run_until_idle()
    with store.transaction() as tx:
        pending = outbox.enqueue(tx, "t", 31, delay=timedelta(days=1))
    assert (late, pending) == (30, 31)
    store.maintain_partitions()  # as the pollers' retention does every minute
    with store.transaction() as tx:  # ids into range 4, so range 3 is behind the newest id
        outbox.enqueue_many(tx, [("t", n) for n in range(32, 41)])
    clock.advance(timedelta(minutes=1))
    outbox.poller().run_until_idle()

    gone = outbox.purge(published_older_than=timedelta(hours=1))
    # Range 0 (9 events) and range 1 (10) were dropped; range 2 holds a dead letter, range 3
    # a pending event: their rows published before the cutoff are deleted one by one.
    assert gone == 9 + 10 + 9
    assert _ranges(store)[0] == (20, 30)
    tables = _tables(admin, schema)
    assert "outbox_events_p0" not in tables and "outbox_deliveries_p1" not in tables
    assert {"outbox_events_p2", "outbox_deliveries_p2"} <= tables
    assert store.get(pending) is not None and store.get(late) is not None
    assert [d.event.payload for d in store.dead_letters()] == ["dead"]
    assert store.records(1) == [] and store.get(1) is None
    # Partitions ahead of the newest id were made by the same maintenance.
    assert _ranges(store)[-1][1] >= (40 // 10 + 1 + partitions.AHEAD) * 10
    store.close()


def test_a_partition_a_late_commit_lands_in_while_it_is_detached_goes_back(
    pg_url: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An enqueue that took an id in a range before maintenance found the range finished may
    # commit while the range is detached (DETACH ... CONCURRENTLY waits for it): its event is
    # then in the detached table, which must go back instead of being dropped.
    store, outbox, clock = _published(pg_url, schema, 24)
    detach = partitions._detach

    def detach_then_a_late_commit(conn: Any, names: Any, part: Any, *, finalize: bool) -> None:
        detach(conn, names, part, finalize=finalize)
        if part.upper == 20:  # range 1: a pending event committed into the detached table
            table = sql.Identifier(schema, "outbox_events_p1")
            conn.execute(sql.SQL("DELETE FROM {} WHERE id = 15").format(table))
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (id, topic, payload, headers, created_at, available_at)"
                    " VALUES (15, 't', '0', '{{}}', now(), now())"
                ).format(table)
            )

    monkeypatch.setattr(partitions, "_detach", detach_then_a_late_commit)
    clock.advance(timedelta(hours=2))
    gone = outbox.purge(published_older_than=timedelta(hours=1))
    assert (None, 10) not in _ranges(store) and (10, 20) in _ranges(store)
    event = store.get(15)
    assert event is not None and event.published_at is None  # back, and claimable
    assert gone == 9 + 9 + 5  # range 0 dropped; range 1's other rows and range 2's deleted
    store.close()


def _interrupt_detach(
    pg_url: str, schema: str, admin: psycopg.Connection[Any], partition: str
) -> None:
    """Leave a detach of ``partition`` half done, as a maintenance killed midway does: a
    reader keeps the partitioned table in use, the detach waits for it and is cancelled."""
    with psycopg.connect(pg_url) as reader, psycopg.connect(pg_url, autocommit=True) as detacher:
        reader.execute(
            sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "outbox_events"))
        )
        pid = detacher.info.backend_pid
        failure: list[BaseException] = []

        def detach() -> None:
            try:
                detacher.execute(
                    sql.SQL("ALTER TABLE {} DETACH PARTITION {} CONCURRENTLY").format(
                        sql.Identifier(schema, "outbox_events"),
                        sql.Identifier(schema, partition),
                    )
                )
            except psycopg.Error as exc:
                failure.append(exc)

        runner = threading.Thread(target=detach)
        runner.start()
        waiting = (
            "SELECT count(*) FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'"
        )
        for _ in range(100_000):  # until it waits for the reader (bounded)
            if admin.execute(waiting, (pid,)).fetchone() == (1,):
                break
        admin.execute("SELECT pg_cancel_backend(%s)", (pid,))
        runner.join(30)
        reader.rollback()
    assert failure and isinstance(failure[0], psycopg.errors.QueryCanceled)


def test_a_detach_left_half_done_is_finished_by_the_next_maintenance(
    pg_url: str, schema: str, admin: psycopg.Connection[Any]
) -> None:
    store, outbox, clock = _published(pg_url, schema, 14)
    _interrupt_detach(pg_url, schema, admin, "outbox_events_p0")
    with store.dialect.pool.connection("list") as conn:
        (first, *_) = partitions.partitions(conn, store.names)
    assert first.detaching
    found = [f for f in server_findings(store, Limits()) if "interrupted" in f.summary]
    assert [(f.check, f.severity) for f in found] == [("partitions", "warning")]
    assert "detach of partition(s) [0] was interrupted" in found[0].summary
    clock.advance(timedelta(hours=2))
    assert outbox.purge(published_older_than=timedelta(hours=1)) == 9 + 5
    assert "outbox_events_p0" not in _tables(admin, schema)
    store.close()


def test_a_detach_left_half_done_above_a_finished_range_is_finished_first(
    pg_url: str, schema: str, admin: psycopg.Connection[Any]
) -> None:
    """PostgreSQL detaches one partition of a table at a time: range 1 left pending would
    refuse range 0's detach. The maintenance finishes range 1 first, then retires range 0, in
    one pass."""
    store, _, clock = _published(pg_url, schema, 24)
    _interrupt_detach(pg_url, schema, admin, "outbox_events_p1")
    clock.advance(timedelta(hours=2))
    assert store.maintain_partitions(before=clock.now() - timedelta(hours=1)) == 9 + 10
    tables = _tables(admin, schema)
    assert "outbox_events_p0" not in tables and "outbox_events_p1" not in tables
    store.close()


def test_a_store_and_a_table_of_different_layouts_are_refused_naming_the_option(
    pg_url: str, schema: str
) -> None:
    partitioned = PostgresStore(pg_url, schema=schema, partition_size=10)
    partitioned.migrate()
    plain = PostgresStore(pg_url, schema=schema)
    with pytest.raises(
        SchemaError, match="partitioned layout: open the store with the partition_size"
    ):
        plain.stats(now=None)
    with pytest.raises(SchemaError, match="partition_size"):
        plain.migrate()
    plain.close()
    partitioned.close()


def test_a_plain_table_opened_for_partitions_is_refused_until_migrate_converts_it(
    pg_url: str, schema: str
) -> None:
    plain = PostgresStore(pg_url, schema=schema)
    plain.migrate()
    plain.close()
    store = PostgresStore(pg_url, schema=schema, partition_size=10)
    with pytest.raises(SchemaError, match="not partitioned: run migrate"):
        store.stats(now=None)
    store.migrate()
    assert store.stats(now=None).pending == 0
    store.close()


def test_ids_beyond_the_partitions_ahead_fail_the_enqueue_naming_the_maintenance(
    pg_url: str, schema: str
) -> None:
    store = PostgresStore(pg_url, schema=schema, partition_size=10)
    store.migrate()
    outbox = _outbox(store, EventBus(), FrozenClock(START))
    top = _ranges(store)[-1][1]
    ready = r"no partition ready .*maintain_partitions\(\)"
    with pytest.raises(StoreError, match=ready), store.transaction() as tx:
        outbox.enqueue_many(tx, [("t", n) for n in range(top + 5)])
    assert store.stats(now=None).pending == 0  # the app's transaction rolled back whole
    store.maintain_partitions()  # ahead of the newest id, which a failed insert does not move
    with store.transaction() as tx:
        assert len(outbox.enqueue_many(tx, [("t", n) for n in range(30)])) == 30
    store.maintain_partitions()
    assert _ranges(store)[-1][1] > 30 + partitions.AHEAD * 10
    store.close()


@pytest.mark.parametrize("size", [0, 9, 10**12 + 1, True, 1.5, "10"])
def test_a_bad_partition_size_is_refused_naming_it(pg_url: str, size: object) -> None:
    with pytest.raises(ConfigurationError, match=r"partition_size must be an integer from 10"):
        PostgresStore(pg_url, partition_size=size)  # type: ignore[arg-type]


def test_maintenance_is_refused_on_the_other_layout(pg_url: str) -> None:
    store = PostgresStore(pg_url)
    with pytest.raises(ConfigurationError, match="partitioned layout"):
        store.maintain_partitions()
    store.close()


def test_the_doctor_names_a_store_short_of_partitions_ahead_with_the_fix(
    pg_url: str, schema: str, admin: psycopg.Connection[Any]
) -> None:
    store = PostgresStore(pg_url, schema=schema, partition_size=10)
    store.migrate()

    def partitions_finding() -> Any:
        (found,) = [f for f in server_findings(store, Limits()) if f.check == "partitions"]
        return found

    assert partitions_finding().severity == "ok"
    seq = sql.Identifier(schema, "outbox_events_id_seq")
    admin.execute(sql.SQL("SELECT setval({}, 25)").format(sql.Literal(seq.as_string(admin))))
    assert partitions_finding().severity == "warning"  # one range ready, of three
    admin.execute(sql.SQL("SELECT setval({}, 35)").format(sql.Literal(seq.as_string(admin))))
    finding = partitions_finding()
    assert finding.severity == "problem"
    assert "enqueues fail once the ids pass 39" in finding.summary
    assert "store.maintain_partitions()" in finding.fix
    store.maintain_partitions()
    assert partitions_finding().severity == "ok"
    store.close()


def test_two_maintenances_at_once_make_each_partition_once_and_drop_each_once(
    pg_url: str, schema: str
) -> None:
    # The pollers of several processes run the retention each minute, possibly at once: the
    # partitions ahead are made under a lock, and a range another one detached is left to it.
    # PostgreSQL detaches one partition of a table at a time: a maintenance refused because
    # the other one's detach is pending leaves the rest of the list to it.
    store, _, clock = _published(pg_url, schema, 34)
    others = [PostgresStore(pg_url, schema=schema, partition_size=10) for _ in range(2)]
    ready = threading.Barrier(2)
    dropped: list[int] = []
    failures: list[BaseException] = []

    def maintain(other: PostgresStore) -> None:
        try:
            ready.wait(30)
            dropped.append(other.maintain_partitions(before=clock.now() + timedelta(hours=1)))
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=maintain, args=(other,)) for other in others]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for other in others:
        other.close()
    assert failures == []
    assert sum(dropped) == 9 + 10 + 10  # ranges 0, 1 and 2, each dropped by one of the two
    ranges = _ranges(store)
    assert ranges == [(30, 40), (40, 50), (50, 60), (60, 70)]  # none twice, none missing
    store.close()
