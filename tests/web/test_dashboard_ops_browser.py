"""The dashboard at scale, in a real browser (Debian's chromium through Playwright, as
``test_dashboard_browser.py``): 10,020 published events before the due ones (the page used to
read only the lowest 10,000 ids), paging past them, a filter, a bulk requeue through its
preview, the held keys with their dead events, and a page of dead letters with 1 MiB payloads
under a stated memory bound (the server's allocations, traced while the browser loads it)."""

from __future__ import annotations

import logging
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from outboxkit import EventBus, FrozenClock, Outbox, open_store
from outboxkit.contrib.web import Dashboard, DashboardServer

from .test_dashboard_browser import CHROMIUM, _browser_or_skip

TOKEN = "ops-browser-token-5678"
PUBLISHED = 10_020
DUE = 20
DECLINED = 30  # dead letters of invoice.due, "card declined"
TIMEOUTS = 5  # dead letters of invoice.due, "gateway timeout", keys cust-0..cust-4
MEMORY_BOUND = 64 << 20  # bytes the server may allocate at its peak (measured: 43 MiB)
BIG_LETTERS = 60


class Shop:
    """A SQLite outbox under a test clock, ``dead_key="hold"``; ``bill`` fails with the
    payload's ``error``."""

    def __init__(self, tmp_path: Path) -> None:
        self.clock = FrozenClock("2030-01-01T09:00:00Z")
        bus = EventBus()

        @bus.handler("order.placed", name="stock")
        def stock(event: Any, ctx: Any) -> None:
            pass

        @bus.handler("invoice.due", name="bill")
        def bill(event: Any, ctx: Any) -> None:
            raise RuntimeError(event.payload["error"])

        self.store = open_store(f"sqlite:///{tmp_path / 'shop.db'}")
        self.outbox = Outbox(self.store, bus, clock=self.clock, max_retries=0, dead_key="hold")

    def enqueue_many(self, events: list[tuple[str, Any]], **options: Any) -> list[int]:
        ids: list[int] = []
        for first in range(0, len(events), 1000):
            with self.store.transaction() as tx:
                ids += self.outbox.enqueue_many(tx, events[first : first + 1000])
        return ids

    def drain(self) -> None:
        self.outbox.poller(batch_size=500, transaction="per_batch").run_until_idle()


@pytest.fixture
def shop(tmp_path: Path) -> Iterator[Shop]:
    shop = Shop(tmp_path)
    yield shop
    shop.store.close()


@pytest.fixture
def served(shop: Shop) -> Iterator[DashboardServer]:
    server = DashboardServer(
        Dashboard(shop.outbox, token=TOKEN, name="sqlite:///shop.db"), port=0, sample_every=None
    )
    server.start()
    yield server
    server.stop()


def _history(shop: Shop) -> tuple[list[int], list[int], list[int]]:
    """10,020 published, then dead letters (30 declined, 5 timeouts holding keys), then 20
    due. Returns the due, declined and timed-out ids."""
    shop.enqueue_many([("order.placed", {"n": n}) for n in range(PUBLISHED)])
    shop.drain()
    declined = shop.enqueue_many([("invoice.due", {"error": "card declined"})] * DECLINED)
    with shop.store.transaction() as tx:
        timeouts = [
            shop.outbox.enqueue(tx, "invoice.due", {"error": "gateway timeout"}, key=f"cust-{n}")
            for n in range(TIMEOUTS)
        ]
    shop.drain()
    shop.clock.advance(60)
    due = shop.enqueue_many([("order.placed", {"late": n}) for n in range(DUE)])
    shop.clock.advance(60)
    return due, declined, timeouts


def _sign_in(page: Any, base: str) -> None:
    page.goto(f"{base}/login")
    page.fill("input[name=token]", TOKEN)
    page.click("#sign-in-button")
    page.wait_for_url(f"{base}/?done=signed-in")


def _launch(playwright: Any) -> Any:
    return playwright.chromium.launch(
        executable_path=str(CHROMIUM), args=["--no-sandbox", "--headless", "--disable-gpu"]
    )


def test_paging_filters_bulk_requeue_and_held_keys_in_the_browser(
    shop: Shop, served: DashboardServer, caplog: pytest.LogCaptureFixture
) -> None:
    sync_playwright = _browser_or_skip()
    caplog.set_level(logging.INFO, logger="outboxkit.web")
    due, declined, timeouts = _history(shop)
    assert min(due) > 10_000
    base = served.origin
    with sync_playwright() as playwright:
        browser = _launch(playwright)
        try:
            page = browser.new_context().new_page()
            _sign_in(page, base)

            # The overview finds the due events past the first 10,000 ids: each survey reads
            # a bounded window and starts past the published events the last one found.
            for _ in range(4):
                page.goto(f"{base}/?refresh=off")
                rows = page.locator("#oldest-due-events tbody tr")
                if rows.count():
                    break
            assert rows.count() == 10
            shown = [int(rows.nth(i).locator("td").first.inner_text()) for i in range(10)]
            assert shown == due[:10]
            assert page.locator("#count-pending").inner_text() == str(DUE)

            # The held keys, each with its dead event (dead_key="hold").
            held = page.locator("#held-keys tbody tr")
            assert held.count() == TIMEOUTS
            first = held.nth(0)
            assert first.locator(".key").inner_text() == "cust-0"
            assert first.locator("a").inner_text() == str(timeouts[0])

            # Every event, page by page (keyset): the due ones after 10,000 published.
            page.goto(f"{base}/events?state=due")
            pages_read = 1
            while page.locator("#events tbody tr").count() == 0:
                page.click("#next")
                pages_read += 1
                assert pages_read < 10
            ids = [
                int(t) for t in page.locator("#events tbody tr td:first-child").all_inner_texts()
            ]
            assert ids == due[: len(ids)] and len(ids) == DUE
            assert pages_read >= 3  # 10,000+ events read past, a bounded window at a time

            # A filter: the dead letters whose error says "declined".
            page.goto(f"{base}/dead")
            page.fill("#filters input[name=error]", "declined")
            page.click("#filters button")
            listed = page.locator("#dead-letters tbody tr")
            assert listed.count() == 25  # one page
            page.click("#next")
            assert page.locator("#dead-letters tbody tr").count() == DECLINED - 25
            assert page.locator("#end").count() == 1

            # Bulk requeue: the preview says how many and which, then it is done.
            page.goto(f"{base}/dead?error=declined")
            page.click("#bulk-requeue")
            assert page.locator("#preview-count").inner_text() == str(DECLINED)
            previewed = page.locator("#preview-ids a").all_inner_texts()
            assert [int(i) for i in previewed] == declined[:20]
            assert shop.outbox.stats().dead == DECLINED + TIMEOUTS  # nothing done yet
            page.click("#confirm")
            page.wait_for_url(f"{base}/dead?error=declined&done=requeued&n={DECLINED}")
            assert page.locator("#message").inner_text() == f"requeued {DECLINED} dead letter(s)"
            assert page.locator("#dead-letters tbody tr").count() == 0
            assert shop.outbox.stats().dead == TIMEOUTS
        finally:
            browser.close()
    assert f"requeued {DECLINED} dead letter(s) of {DECLINED} asked" in caplog.text
    assert TOKEN not in caplog.text


def test_a_page_of_dead_letters_with_1_mib_payloads_stays_under_the_bound(
    shop: Shop, served: DashboardServer
) -> None:
    """60 dead letters of about 1 MiB each (60 MiB of payloads): the dead letters' page, the
    overview and one of the events keep the server under ``MEMORY_BOUND`` at its peak (reads
    of 10 events, list rows without payloads, an event's page showing 64 KiB of it)."""
    sync_playwright = _browser_or_skip()
    payload = {"error": "card declined", "blob": "x" * 1_000_000}
    ids = shop.enqueue_many([("invoice.due", payload)] * BIG_LETTERS)
    poller = shop.outbox.poller(batch_size=5)
    while poller.run_once().claimed:
        shop.clock.advance(1)  # each batch fails at an instant of its own, as in production
    assert shop.outbox.stats().dead == BIG_LETTERS
    base = served.origin
    with sync_playwright() as playwright:
        browser = _launch(playwright)
        try:
            page = browser.new_context().new_page()
            _sign_in(page, base)
            tracemalloc.start()
            try:
                page.goto(f"{base}/dead")
                assert page.locator("#dead-letters tbody tr").count() == 25
                page.goto(f"{base}/?refresh=off")
                assert page.locator("#count-dead").inner_text() == str(BIG_LETTERS)
                page.goto(f"{base}/events/{ids[0]}")
                assert "more characters" in page.locator("pre").inner_text()
                _, peak = tracemalloc.get_traced_memory()
                print(f"dashboard peak allocations, 1 MiB payloads: {peak / 2**20:.1f} MiB")
            finally:
                tracemalloc.stop()
        finally:
            browser.close()
    assert peak < MEMORY_BOUND, f"peak {peak / 2**20:.1f} MiB"
