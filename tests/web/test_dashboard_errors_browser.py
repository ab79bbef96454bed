"""The error of each failed attempt on an event's page, in a real browser (Debian's chromium
through Playwright, as ``test_dashboard_browser.py``), on PostgreSQL and SQLite, whose stores
keep them (``capabilities.error_history``); and what the page says on a store that keeps the
last only."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from outboxkit import EventBus, FrozenClock, Outbox, open_store
from outboxkit.contrib.web import Dashboard, DashboardServer, pages
from tests.integration.pg.conftest import pg_schema, pg_store, pg_url

from .test_dashboard_browser import _browser_or_skip
from .test_dashboard_ops_browser import _launch

__all__ = ["pg_schema", "pg_store", "pg_url"]

ERRORS = ["gateway timeout", "card declined", "gateway timeout again"]


def _failing_outbox(store: Any) -> tuple[Outbox, int]:
    """An event whose handler failed three times (two retries, then dead): its id."""
    clock = FrozenClock("2030-01-01T09:00:00Z")
    bus = EventBus()
    failures = iter(ERRORS)

    @bus.handler("invoice.due", name="bill")
    def bill(event: Any, ctx: Any) -> None:
        raise RuntimeError(next(failures))

    outbox = Outbox(store, bus, clock=clock, max_retries=2, load_entry_points=False)
    with store.transaction() as tx:
        event_id = outbox.enqueue(tx, "invoice.due", {"n": 1})
    for _ in ERRORS:
        outbox.poller().run_once()
        clock.advance(timedelta(hours=1))
    return outbox, event_id


@pytest.fixture(params=["pg", "sqlite"])
def served(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[DashboardServer, int]]:
    if request.param == "pg":
        store: Any = request.getfixturevalue("pg_store")
    else:
        store = open_store(f"sqlite:///{tmp_path / 'shop.db'}")
        store.migrate()
    outbox, event_id = _failing_outbox(store)
    server = DashboardServer(Dashboard(outbox, name=request.param), port=0, sample_every=None)
    server.start()
    yield server, event_id
    server.stop()
    if request.param == "sqlite":
        store.close()


def test_an_events_page_shows_the_error_of_each_attempt(
    served: tuple[DashboardServer, int],
) -> None:
    sync_playwright = _browser_or_skip()
    server, event_id = served
    with sync_playwright() as playwright:
        browser = _launch(playwright)
        try:
            page = browser.new_context().new_page()
            page.goto(f"{server.origin}/events/{event_id}")
            rows = page.locator("#attempt-errors tbody tr")
            assert rows.count() == 3
            cells = [rows.nth(i).locator("td").all_inner_texts() for i in range(3)]
            assert [c[0] for c in cells] == ["1", "2", "3"]
            assert [c[2] for c in cells] == [f"bill: RuntimeError: {e}" for e in ERRORS]
            assert cells[0][1] < cells[1][1] < cells[2][1]  # one hour apart, oldest first
            assert page.locator("#state").inner_text() == "dead"
        finally:
            browser.close()


def test_a_store_keeping_the_last_error_only_says_so(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'shop.db'}")
    # A store that keeps the last error only (as MariaDB's): SQLite declaring no history.
    store.capabilities = replace(store.capabilities, error_history=False)
    try:
        store.migrate()
        outbox, event_id = _failing_outbox(store)
        dashboard = Dashboard(outbox, name="sqlite")
        assert dashboard.errors(event_id) is None and outbox.attempt_errors(event_id) == []
        event, letter = dashboard.event(event_id)
        assert event is not None
        shown = pages.event_page(event, letter, errors=None)
        assert "This store keeps the last error only" in shown
        assert "gateway timeout again" in shown  # the last error, in the table above
    finally:
        store.close()
