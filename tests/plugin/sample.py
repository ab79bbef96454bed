"""The sample app the test kit's tests run under pytester, and how they run it.

The ``app`` fixture (``tests/plugin/conftest.py``) writes the app, its ini and the store
options into a pytester folder; ``run`` runs one test file there.
"""

from __future__ import annotations

import pytest

from tests.integration.pg.conftest import pg_url_from_env, require_server
from tests.integration.pg.conftest import test_url as pg_test_url

SAMPLE_APP = """
from outboxkit import EventBus, MemoryStore, Outbox, Reject

bus = EventBus()
calls = {"flaky": 0}


@bus.handler("order.placed", name="reserve-stock")
def reserve_stock(event, ctx):
    ctx.enqueue("stock.reserved", {"order_id": event.payload["order_id"]})


@bus.handler("order.placed", name="fraud-check")
def fraud_check(event, ctx):
    if event.payload.get("fraud"):
        raise Reject("looks fraudulent")


@bus.handler("stock.reserved", name="notify-warehouse")
def notify_warehouse(event, ctx):
    pass


@bus.handler("payment.captured", name="flaky-ledger")
def flaky_ledger(event, ctx):
    calls["flaky"] += 1
    if ctx.attempt <= event.payload["fail_times"]:
        raise ConnectionError(f"ledger down (attempt {ctx.attempt})")


@bus.handler("email.requested", name="broken-mailer")
def broken_mailer(event, ctx):
    raise RuntimeError("smtp exploded")


@bus.handler("ping", name="ping-pong")
def ping_pong(event, ctx):
    ctx.enqueue("pong", {})


@bus.handler("pong", name="pong-ping")
def pong_ping(event, ctx):
    ctx.enqueue("ping", {})


outbox = Outbox(MemoryStore(), bus, max_retries=10)
"""

ASYNC_APP = """
import asyncio
import threading

from outboxkit import EventBus, MemoryStore, Outbox, Reject

bus = EventBus()
loops = []  # the event loop each async handler ran on
threads = []  # the thread the blocking handler ran in


@bus.handler("order.placed", name="reserve-stock")
async def reserve_stock(event, ctx):
    loops.append(asyncio.get_running_loop())
    await asyncio.sleep(0)  # a real suspension: the handler runs on the loop
    ctx.enqueue("stock.reserved", {"order_id": event.payload["order_id"]})


@bus.handler("order.placed", name="fraud-check")
async def fraud_check(event, ctx):
    if event.payload.get("fraud"):
        raise Reject("looks fraudulent")


@bus.handler("stock.reserved", name="notify-warehouse", transactional=False)
async def notify_warehouse(event, ctx):
    loops.append(asyncio.get_running_loop())


@bus.handler("stock.reserved", name="log-line", transactional=False)
def log_line(event, ctx):  # blocking, not transactional: the asyncio poller runs it in a thread
    threads.append(threading.current_thread())


@bus.handler("email.requested", name="broken-mailer", transactional=False)
async def broken_mailer(event, ctx):
    raise ConnectionError("smtp down")


outbox = Outbox(MemoryStore(), bus, max_retries=10)
"""

HELPERS = """
def enqueue(outbox, topic, payload, **kw):
    with outbox.store.transaction() as conn:
        return outbox.enqueue(conn, topic, payload, **kw)
"""


STORE_ARGS: dict[int, list[str]] = {}
"""The pytest arguments naming each pytester folder's store (by ``id(pytester)``)."""
STORE_CLASS: dict[int, str] = {}
"""The store class each pytester folder's tests see (by ``id(pytester)``)."""


def store_args(backend: str) -> list[str]:
    if backend == "sqlite":
        return []
    if backend == "memory":
        return ["--outbox-store=memory://"]
    url = pg_url_from_env()
    require_server(url)
    return [f"--outbox-store={pg_test_url(url)}"]


def run(app: pytest.Pytester, source: str, *args: str) -> pytest.RunResult:
    app.makepyfile(test_sample=source)
    return app.runpytest_inprocess("-q", "-p", "no:cacheprovider", *STORE_ARGS[id(app)], *args)
