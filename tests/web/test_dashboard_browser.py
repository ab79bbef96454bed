"""``outboxkit web`` in a real headless browser (Debian's chromium, driven by Playwright).

An operator loads the page, sees a dead letter whose topic and error carry HTML and terminal
escape sequences (shown as text, nothing injected), opens it, requeues it with the token, and
after a drain sees it published. A post without the token, and a cross-site post from another
page (with the right token), are refused and change nothing.

The screenshot of the front page the README shows is made here: the test always saves it
under its ``tmp_path``; with ``OUTBOXKIT_UPDATE_SCREENSHOTS=1`` it writes
``docs/dashboard.png`` too. Without ``/usr/bin/chromium`` (or Playwright) the test skips with
the reason, unless ``OUTBOXKIT_REQUIRE_BROWSER=1`` (set by CI), where it fails.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from outboxkit import EventBus, FrozenClock, Outbox, open_store
from outboxkit.contrib.web import Dashboard, DashboardServer
from outboxkit.core.text import printable
from outboxkit.testing import Drain

CHROMIUM = Path("/usr/bin/chromium")
ROOT = Path(__file__).resolve().parents[2]
HOSTILE_TOPIC = "<b>order</b>\x1b[31m.placed\x1b]0;pwned\x07"
HOSTILE_ERROR = "<script>window.pwned = 1</script><img src=x onerror=alert(1)>\x1b[2J\u202eboom"
TOKEN = "browser-test-token-1234"


def _browser_or_skip() -> Any:
    required = os.environ.get("OUTBOXKIT_REQUIRE_BROWSER") == "1"
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if required:
            raise
        pytest.skip("playwright is not installed (pip install -e '.[dev]')")
    if not CHROMIUM.exists():
        if required:
            pytest.fail(f"{CHROMIUM} is missing and OUTBOXKIT_REQUIRE_BROWSER=1")
        pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium)")
    return sync_playwright


class Shop:
    """An outbox on a SQLite file: ``mail`` fails while ``broken`` is set."""

    def __init__(self, tmp_path: Path) -> None:
        self.broken = True
        self.clock = FrozenClock("2030-01-01T09:00:00Z")
        bus = EventBus()

        @bus.handler("order.placed", name="stock")
        def stock(event: Any, ctx: Any) -> None:
            pass

        @bus.handler(HOSTILE_TOPIC, name="mail", transactional=False)
        def mail(event: Any, ctx: Any) -> None:
            if self.broken:
                raise RuntimeError(HOSTILE_ERROR)

        self.store = open_store(f"sqlite:///{tmp_path / 'shop.db'}")
        self.outbox = Outbox(self.store, bus, clock=self.clock, max_retries=0)
        self.drain = Drain(self.outbox, self.clock)

    def enqueue(self, topic: str, payload: Any) -> int:
        with self.store.transaction() as tx:
            event_id: int = self.outbox.enqueue(tx, topic, payload)
        return event_id


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


def _history(shop: Shop, server: DashboardServer) -> int:
    """A morning's backlog: one dead letter, orders delivered, the last ten left due; sampled
    as the virtual clock moves. Returns the dead letter's id."""
    dead_id = shop.enqueue(HOSTILE_TOPIC, {"order_id": 99, "note": "<i>fragile</i>"})
    with shop.drain.expect_failures("mail"):
        shop.drain()
    for n in range(6):
        for i in range(n * 2):
            shop.enqueue("order.placed", {"order_id": n * 10 + i})
        if n < 5:
            shop.drain()
        shop.clock.advance(60)
        server.dashboard.sample()
    return dead_id


def test_an_operator_requeues_a_hostile_dead_letter_in_the_browser(
    shop: Shop, served: DashboardServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sync_playwright = _browser_or_skip()
    caplog.set_level(logging.DEBUG, logger="outboxkit")
    dead_id = _history(shop, served)
    base = served.origin
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=["--no-sandbox", "--headless", "--disable-gpu"]
        )
        try:
            context = browser.new_context(viewport={"width": 1100, "height": 900})
            page = context.new_page()
            dialogs: list[str] = []
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))

            # Load: the counters, the chart, and the dead letter, its text shown as text; the
            # page reloads itself (a meta refresh: no script).
            page.goto(f"{base}/")
            assert page.locator("meta[http-equiv=refresh]").get_attribute("content") == "10"
            assert page.locator("#count-dead").inner_text() == "1"
            assert page.locator("#count-pending").inner_text() == "10"
            assert page.locator("#backlog polyline").count() == 2
            row = page.locator("#dead-letters tbody tr")
            assert row.count() == 1
            assert row.locator(".topic").inner_text() == printable(HOSTILE_TOPIC)
            assert row.locator(".err").inner_text() == printable(
                f"mail: RuntimeError: {HOSTILE_ERROR}"
            )
            assert (
                page.locator("#dead-letters b, #dead-letters script, #dead-letters img").count()
                == 0
            )
            shot = page.screenshot(full_page=True)
            (tmp_path / "dashboard.png").write_bytes(shot)
            if os.environ.get("OUTBOXKIT_UPDATE_SCREENSHOTS") == "1":
                (ROOT / "docs" / "dashboard.png").write_bytes(shot)

            # Show: the event with its records and last error.
            row.locator("a").click()
            page.wait_for_url(f"{base}/events/{dead_id}")
            assert page.locator("#state").inner_text() == "dead"
            assert page.locator("#last-error").inner_text() == printable(
                f"mail: RuntimeError: {HOSTILE_ERROR}"
            )
            assert page.locator("img, script").count() == 0

            # Not signed in: no action on the page, and a post without a session is refused.
            assert page.locator("form[action$='/requeue']").count() == 0
            no_session = page.request.post(
                f"{base}/events/{dead_id}/requeue", form={}, headers={"Origin": base}
            )
            assert no_session.status == 403
            wrong = page.request.post(
                f"{base}/login", form={"token": "not-the-token"}, headers={"Origin": base}
            )
            assert wrong.status == 403

            # Sign in once: the session is a cookie no script can read.
            page.click("#sign-in")
            page.fill("input[name=token]", TOKEN)
            page.click("#sign-in-button")
            page.wait_for_url(f"{base}/?done=signed-in")
            assert page.locator("#message").inner_text() == "signed in"
            assert page.evaluate("document.cookie") == ""  # HttpOnly
            [cookie] = page.context.cookies()
            assert (cookie["httpOnly"], cookie["sameSite"]) == (True, "Strict")

            # A cross-site post carries no session (SameSite=Strict) and has a foreign Origin.
            elsewhere = context.new_page()
            elsewhere.set_content(
                f"<form method='post' action='{base}/events/{dead_id}/purge'>"
                "<button id='go'>go</button></form>"
            )
            with elsewhere.expect_navigation():
                elsewhere.click("#go")
            assert "cross-site request refused" in elsewhere.locator("#message").inner_text()
            elsewhere.close()
            assert shop.outbox.dead_letter(dead_id) is not None

            # Requeue in the session, no token typed; redirected after the post.
            page.goto(f"{base}/events/{dead_id}")
            page.locator("form[action$='/requeue'] button").click()
            page.wait_for_url(f"{base}/events/{dead_id}?done=requeued&n=1")
            assert page.locator("#message").inner_text() == "requeued 1 dead letter(s)"
            assert page.locator("#state").inner_text() == "pending"
            page.reload()  # a GET: nothing re-posted
            assert page.locator("#message").inner_text() == "requeued 1 dead letter(s)"
            shop.broken = False
            shop.drain().assert_delivered(HOSTILE_TOPIC, handler="mail")
            page.reload()
            assert page.locator("#state").inner_text() == "published"
            page.goto(f"{base}/?refresh=off")
            assert page.locator("#count-dead").inner_text() == "0"
            assert dialogs == []
        finally:
            browser.close()
    assert TOKEN not in caplog.text
    # One line for the action: who (the session, the address), what, how many.
    assert re.search(
        rf"dashboard: session \S+ \(127\.0\.0\.1\) from 127\.0\.0\.1 requeued 1 dead "
        rf"letter\(s\) of 1 asked: {dead_id}",
        caplog.text,
    )
