"""What ``outboxkit run`` logs about failures: one line per failed handler run, the traceback
only with the first of a run of identical failures, and the structured fields on the record."""

from __future__ import annotations

import itertools
import logging
from typing import Any

import pytest

from outboxkit import EventBus, FrozenClock, MemoryStore, Outbox, Store
from tests.backends import Target

from .apps import App
from .conftest import Cli

DEAD = 31


def test_31_dead_letters_log_31_tracebacks(
    process_cli: Cli, target: Target, store: Store, app: App
) -> None:
    outbox = Outbox(store, load_entry_points=False)
    with store.transaction() as conn:
        for _ in range(DEAD):
            outbox.enqueue(conn, "invoice.due", {"fail": True})
    result = process_cli("run", app.spec(), "--until-idle", "--max-retries", "0")
    assert result.code == 0, result
    assert store.stats(now=None).dead == DEAD
    assert result.stderr.count("Traceback (most recent call last)") == DEAD
    failure_lines = [line for line in result.stderr.splitlines() if "handler bill failed" in line]
    assert len(failure_lines) == DEAD
    assert result.stderr.count("dead-lettered after 1 attempt(s)") == DEAD


def _drain_failing(errors: Any, events: int, caplog: pytest.LogCaptureFixture) -> MemoryStore:
    """``events`` events whose handler raises ``RuntimeError(next(errors))`` on each of its 4
    attempts (``max_retries=3``), drained to the end under a test clock."""
    bus = EventBus()

    def bill(event: Any, ctx: Any) -> None:
        raise RuntimeError(next(errors))

    bus.subscribe("invoice.due", bill, name="bill")
    store, clock = MemoryStore(), FrozenClock()
    outbox = Outbox(store, bus, clock=clock, max_retries=3, backoff=1, load_entry_points=False)
    with store.transaction() as tx:
        for n in range(events):
            outbox.enqueue(tx, "invoice.due", {"n": n})

    def next_retry() -> bool:
        clock.advance(1)
        return store.stats(now=clock.now()).pending > 0

    with caplog.at_level(logging.WARNING, logger="outboxkit"):
        outbox.poller().run_until_idle(on_idle=next_retry)
    assert store.stats(now=clock.now()).dead == events
    return store


def test_31_dead_letters_after_retries_log_31_tracebacks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _drain_failing(itertools.repeat("card declined"), DEAD, caplog)
    failures = [r for r in caplog.records if "failed on attempt" in r.getMessage()]
    assert len(failures) == DEAD * 4  # one line per failed run
    assert len([r for r in failures if r.exc_info]) == DEAD  # the traceback with the first
    first = failures[0]
    fields = (first.event_id, first.topic, first.handler, first.attempt)  # type: ignore[attr-defined]
    assert fields == (1, "invoice.due", "bill", 1)
    dead = [r for r in caplog.records if "dead-lettered" in r.getMessage()]
    assert len(dead) == DEAD and not any(r.exc_info for r in dead)
    assert {r.attempt for r in dead} == {4}  # type: ignore[attr-defined]


def test_a_new_error_on_retry_logs_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    _drain_failing(iter(["card declined", "timeout", "card declined", "card declined"]), 1, caplog)
    failures = [r for r in caplog.records if "failed on attempt" in r.getMessage()]
    # New, new (against the last attempt's), new again, then the same as the last: no traceback.
    assert [bool(r.exc_info) for r in failures] == [True, True, True, False]
    assert failures[3].getMessage().endswith("card declined (as on the last attempt)")
