"""Error text the database cannot store, on every store.

A handler's exception text and a ``Reject`` reason come from the handler, not through
``enqueue``'s validation: a lone surrogate (``os.fsdecode`` of an odd file name) or a NUL in them
once stuck a SQLite store for good (every later claim failed to decode ``last_error``) and
crashed a PostgreSQL batch (a raw ``UnicodeEncodeError``, or a ``DataError`` for the NUL) with its
events left leased. Now the text is made storable in one place (``outboxkit.core.text.storable``):
NUL and lone surrogates are replaced by their visible Python escapes, and every batch settles.
Not marked ``faults``: one process, a frozen clock.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from contextlib import closing
from typing import Any

import pytest

from outboxkit import Event, EventBus, FrozenClock, Outbox, Reject
from tests.faults._sites import Site

ODD_NAME = os.fsdecode(b"report-\xff.csv")  # "report-\udcff.csv"
SHOWN = "report-\\udcff.csv"

# By name: the odd strings themselves stay out of the test ids and parameters (pytest-xdist
# cannot even send a lone surrogate between its processes).
FAILURES = {
    "surrogate": (lambda: FileNotFoundError(ODD_NAME), f"FileNotFoundError: {SHOWN}"),
    "nul": (lambda: ValueError("bad\x00byte"), "ValueError: bad\\x00byte"),
    "both": (
        lambda: RuntimeError(f"both {ODD_NAME} and \x00"),
        f"RuntimeError: both {SHOWN} and \\x00",
    ),
}
REASONS = {
    "surrogate": (lambda: f"no such file {ODD_NAME}", f"no such file {SHOWN}"),
    "nul": (lambda: "nul\x00reason", "nul\\x00reason"),
}


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    # The poller logs a failure with its traceback, which holds the exception's own text, lone
    # surrogate and all; pytest-xdist could not send such a captured log between processes.
    caplog.set_level(logging.CRITICAL, logger="outboxkit")


def _outbox(site: Site, bus: EventBus, **options: Any) -> Outbox:
    return Outbox(site.store, bus, clock=FrozenClock(), load_entry_points=False, **options)


@pytest.mark.parametrize("transaction", ["per_event", "per_batch"])
@pytest.mark.parametrize("kind", FAILURES)
def test_unstorable_failure_text_is_stored_escaped_and_the_batch_settles(
    site: Site, kind: str, transaction: str
) -> None:
    make, stored = FAILURES[kind]
    bus = EventBus()

    @bus.handler("t", name="fails")
    def fails(event: Event, ctx: Any) -> None:
        raise make()

    outbox = _outbox(site, bus, max_retries=1, transaction=transaction)
    with site.store.transaction() as conn:
        ids = outbox.enqueue_many(conn, [("t", n) for n in range(50)])

    poller = outbox.poller()
    first = poller.run_once()
    assert sorted(first.retried) == ids  # every event settled: none left leased
    assert all(e.last_error == f"fails: {stored}" for e in site.store.events())
    # The store keeps answering: the retry is claimed, dead-lettered, listed and shown.
    outbox.clock.advance(1)  # type: ignore[attr-defined]
    second = poller.run_once()
    assert sorted(second.dead_lettered) == ids
    letters = outbox.dead_letters(limit=100)
    assert [d.event.id for d in letters] == ids
    assert {d.last_error for d in letters} == {f"fails: {stored}"}
    assert outbox.dead_letter(ids[0]) is not None
    assert outbox.stats().dead == 50
    # ... and goes on delivering new events.
    with site.store.transaction() as conn:
        outbox.enqueue(conn, "unrouted", {})
    assert poller.run_once().published


@pytest.mark.parametrize("transaction", ["per_event", "per_batch"])
@pytest.mark.parametrize("kind", REASONS)
def test_unstorable_reject_reason_is_recorded_escaped(
    site: Site, kind: str, transaction: str
) -> None:
    make, stored = REASONS[kind]
    bus = EventBus()

    @bus.handler("t", name="rejects")
    def rejects(event: Event, ctx: Any) -> None:
        raise Reject(make())

    outbox = _outbox(site, bus, transaction=transaction)
    with site.store.transaction() as conn:
        ids = outbox.enqueue_many(conn, [("t", n) for n in range(3)])
    report = outbox.poller().run_once()
    assert sorted(report.published) == ids
    assert [d.error for d in report.rejected] == [stored] * 3
    assert [r.reason for r in site.store.records(ids[0])] == [stored]


def test_a_reject_reason_that_is_not_a_string_is_recorded_as_its_text(site: Site) -> None:
    bus = EventBus()

    @bus.handler("t", name="rejects")
    def rejects(event: Event, ctx: Any) -> None:
        raise Reject(42)  # type: ignore[arg-type]

    outbox = _outbox(site, bus)
    with site.store.transaction() as conn:
        event_id = outbox.enqueue(conn, "t", {})
    assert outbox.poller().run_once().published == [event_id]
    assert [r.reason for r in site.store.records(event_id)] == ["42"]


def test_an_exception_whose_str_raises_is_described_by_its_type(site: Site) -> None:
    class Hostile(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    bus = EventBus()

    @bus.handler("t", name="hostile")
    def hostile(event: Event, ctx: Any) -> None:
        raise Hostile

    outbox = _outbox(site, bus, max_retries=0)
    with site.store.transaction() as conn:
        event_id = outbox.enqueue(conn, "t", {})
    assert outbox.poller().run_once().dead_lettered == [event_id]
    letter = outbox.dead_letter(event_id)
    assert letter is not None
    assert letter.last_error == "hostile: Hostile: <unprintable Hostile: str() raised RuntimeError>"


def test_a_huge_error_text_is_cut(site: Site) -> None:
    bus = EventBus()

    @bus.handler("t", name="loud")
    def loud(event: Event, ctx: Any) -> None:
        raise ValueError("x" * 1_000_000)

    outbox = _outbox(site, bus, max_retries=0)
    with site.store.transaction() as conn:
        event_id = outbox.enqueue(conn, "t", {})
    outbox.poller().run_once()
    letter = outbox.dead_letter(event_id)
    assert letter is not None and letter.last_error is not None
    assert len(letter.last_error) == 4000
    assert letter.last_error.endswith(" ... [cut]")


def test_sqlite_text_that_is_not_utf8_reads_back_escaped(site: Site) -> None:
    """Rows an older version (or anyone else) wrote with bytes that are not UTF-8 - what a lone
    surrogate became in SQLite's JSON functions - no longer stop claims, listings and stats."""
    if site.backend != "sqlite":
        pytest.skip("SQLite keeps whatever bytes it is given; the other stores refuse them")
    bus = EventBus()
    outbox = _outbox(site, bus, max_retries=0)
    with site.store.transaction() as conn:
        dead, due = outbox.enqueue_many(conn, [("dead", {}), ("due", {})])
    path = site.url.removeprefix("sqlite:///")
    with closing(sqlite3.connect(path)) as raw, raw:
        raw.execute(
            "UPDATE outbox_events SET failed_at = 1, last_error = CAST(X'6261642DEDB3BF' AS TEXT),"
            " topic = CAST(X'646561642DFF' AS TEXT) WHERE id = ?",
            (dead,),
        )
        raw.execute(
            "UPDATE outbox_events SET last_error = CAST(X'FF' AS TEXT) WHERE id = ?", (due,)
        )
    assert outbox.poller().run_once().published == [due]
    (letter,) = outbox.dead_letters()
    assert (letter.event.topic, letter.last_error) == ("dead-\\xff", "bad-\\xed\\xb3\\xbf")
    assert {e.id for e in site.store.events()} == {dead, due}
    assert outbox.stats().dead == 1
