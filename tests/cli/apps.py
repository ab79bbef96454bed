"""The app the CLI tests run, and events seeded in every state.

``APP_SOURCE`` is written to a module of its own per test (``cli_app_<hex>.py`` in a folder on
the import path, of the test and of its subprocesses). It opens its own store from
``CLI_TEST_STORE`` / ``CLI_TEST_STORE_OPTIONS`` and has:

- ``order.placed`` handlers ``reserve`` (succeeds), ``audit`` (rejects ``{"reject": ...}``) and
  ``mail`` (non-transactional, fails ``{"fail": ...}``), and ``invoice.due`` -> ``bill`` (fails
  ``{"fail": ...}``): what ``seed`` uses;
- ``job.run`` -> ``work`` (non-transactional): touches ``started-<event>-<pid>`` in the module's
  folder, waits for a file named ``gate`` there when the payload says ``{"block": true}`` (so a
  test decides when "mid-drain" ends, without sleeping; ``"gate": NAME`` names another file),
  fails on ``{"fail": true}``, and touches ``done-<event>-<pid>`` when it returns.

``ASYNC_APP_SOURCE`` is the same app with ``async def`` handlers (``outboxkit run`` picks the
asyncio poller for it): ``order.placed`` -> ``reserve`` (transactional, enqueues a
``stock.reserved`` follow-up) -> ``ship``; ``job.run`` -> ``work`` (non-transactional, as above,
waiting for ``gate`` with ``await``). For a memory store, which lives and dies with the one
``outboxkit run`` process, ``CLI_TEST_SEED`` (a JSON list of ``[topic, payload]``) is enqueued
when the module is imported, and with ``CLI_TEST_DUMP`` set the process prints the store's
events as one ``app state: <JSON>`` line on stderr when it exits (see ``dumped``).
"""

from __future__ import annotations

import importlib
import json
import re
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

from outboxkit import EventBus, FrozenClock, Outbox, Store

APP_SOURCE = '''
"""An app for the outboxkit CLI tests (written by tests/cli/apps.py)."""
import json
import os
import pathlib
import time

from outboxkit import EventBus, Outbox, Reject, open_store

HERE = pathlib.Path(__file__).parent
bus = EventBus()


@bus.handler("order.placed", name="reserve")
def reserve(event, ctx):
    pass


@bus.handler("order.placed", name="audit")
def audit(event, ctx):
    if event.payload.get("reject"):
        raise Reject("audit says no")


@bus.handler("order.placed", name="mail", transactional=False)
def mail(event, ctx):
    if event.payload.get("fail"):
        raise RuntimeError("mail bounced")


@bus.handler("invoice.due", name="bill")
def bill(event, ctx):
    if event.payload.get("fail"):
        raise RuntimeError("card declined")


@bus.handler("job.run", name="work", transactional=False)
def work(event, ctx):
    (HERE / f"started-{event.id}-{os.getpid()}").touch()
    if event.payload.get("block"):
        gate = HERE / event.payload.get("gate", "gate")
        give_up = time.monotonic() + 120  # never hang a test run for good
        while not gate.exists() and time.monotonic() < give_up:
            time.sleep(0.005)
    if event.payload.get("fail"):
        raise RuntimeError("job failed")
    (HERE / f"done-{event.id}-{os.getpid()}").touch()


store = open_store(
    os.environ["CLI_TEST_STORE"], **json.loads(os.environ.get("CLI_TEST_STORE_OPTIONS") or "{}")
)
outbox = Outbox(store, bus, max_retries=5, backoff=3600)
held = Outbox(store, bus, max_retries=5, backoff=3600, dead_key="hold")  # the same, holding keys
not_an_outbox = bus
'''


ASYNC_APP_SOURCE = '''
"""An asyncio app for the outboxkit CLI tests (written by tests/cli/apps.py)."""
import asyncio
import atexit
import json
import os
import pathlib
import sys
import time

from outboxkit import EventBus, Outbox, open_store

HERE = pathlib.Path(__file__).parent
bus = EventBus()


@bus.handler("order.placed", name="reserve")
async def reserve(event, ctx):
    await asyncio.sleep(0)
    ctx.enqueue("stock.reserved", {"order": event.payload.get("n")})


@bus.handler("stock.reserved", name="ship", transactional=False)
async def ship(event, ctx):
    await asyncio.sleep(0)


@bus.handler("job.run", name="work", transactional=False)
async def work(event, ctx):
    (HERE / f"started-{event.id}-{os.getpid()}").touch()
    if event.payload.get("block"):
        give_up = time.monotonic() + 120  # never hang a test run for good
        while not (HERE / "gate").exists() and time.monotonic() < give_up:
            await asyncio.sleep(0.005)
    if event.payload.get("fail"):
        raise RuntimeError("job failed")
    (HERE / f"done-{event.id}-{os.getpid()}").touch()


store = open_store(
    os.environ["CLI_TEST_STORE"], **json.loads(os.environ.get("CLI_TEST_STORE_OPTIONS") or "{}")
)
outbox = Outbox(store, bus, max_retries=5, backoff=3600)

if os.environ.get("CLI_TEST_SEED"):
    with store.transaction() as tx:
        for topic, payload in json.loads(os.environ["CLI_TEST_SEED"]):
            outbox.enqueue(tx, topic, payload)


def dump():
    events = store.events(after_id=0, limit=10_000)
    state = [
        {
            "id": e.id,
            "topic": e.topic,
            "state": e.state.value,
            "attempts": e.attempts,
            "leased": e.locked_until is not None,
            "records": [[r.handler, r.outcome.value] for r in store.records(e.id)],
        }
        for e in events
    ]
    print("app state: " + json.dumps(state), file=sys.stderr, flush=True)


if os.environ.get("CLI_TEST_DUMP"):
    atexit.register(dump)
'''


@dataclass
class App:
    """One written app module: its name, folder, and (once imported here) the module."""

    name: str
    folder: Path
    module: ModuleType | None = field(default=None, repr=False)

    def spec(self, attribute: str = "outbox") -> str:
        return f"{self.name}:{attribute}"

    def load(self) -> ModuleType:
        """Import it in this process (its store comes from this process's environment)."""
        if self.module is None:
            self.module = importlib.import_module(self.name)
        return self.module

    @property
    def bus(self) -> EventBus:
        bus: EventBus = self.load().bus
        return bus

    def gate(self, name: str = "gate") -> None:
        """Let every ``work`` handler blocked on the file ``name`` return."""
        (self.folder / name).touch()

    def started(self) -> dict[int, set[int]]:
        """Event id -> the pids whose ``work`` handler started on it."""
        return _markers(self.folder, "started")

    def done(self) -> dict[int, set[int]]:
        return _markers(self.folder, "done")


def _markers(folder: Path, kind: str) -> dict[int, set[int]]:
    found: dict[int, set[int]] = {}
    for path in folder.glob(f"{kind}-*-*"):
        _, event_id, pid = path.name.split("-")
        found.setdefault(int(event_id), set()).add(int(pid))
    return found


def write_app(folder: Path, source: str = APP_SOURCE) -> App:
    folder.mkdir(parents=True, exist_ok=True)
    name = f"cli_app_{uuid.uuid4().hex[:12]}"
    (folder / f"{name}.py").write_text(source, encoding="utf-8")
    importlib.invalidate_caches()
    return App(name, folder)


def dumped(stderr: str) -> dict[int, dict[str, Any]]:
    """The events an ``ASYNC_APP_SOURCE`` process printed when it exited, by id."""
    lines = re.findall(r"^app state: (.*)$", stderr, flags=re.M)
    assert len(lines) == 1, stderr
    return {event["id"]: event for event in json.loads(lines[0])}


@dataclass(frozen=True)
class Seeded:
    """The ids ``seed`` wrote, by what became of them."""

    now: datetime
    published_old: list[int]  # published 10 days ago
    published_new: list[int]  # published an hour ago
    dead_old: int  # order.placed, dead 10 days ago: reserve succeeded, audit rejected, mail failed
    dead_new: int  # invoice.due, dead an hour ago
    parked: int  # invoice.due, failed 2 hours ago, retry parked a day later
    due: list[int]  # order.placed, due since a minute ago, never polled

    @property
    def pending(self) -> list[int]:
        return [self.parked, *self.due]


def seed(store: Store, bus: EventBus) -> Seeded:
    """Events in every state, at known instants before now (see ``Seeded``)."""
    now = datetime.now(UTC)
    clock = FrozenClock(now - timedelta(days=10))
    outbox = Outbox(store, bus, clock=clock, max_retries=0, load_entry_points=False)

    def enqueue(topic: str, payload: dict[str, Any]) -> int:
        with store.transaction() as conn:
            return outbox.enqueue(conn, topic, payload)

    old = [enqueue("order.placed", {"n": 1}), enqueue("order.placed", {"n": 2})]
    dead_old = enqueue("order.placed", {"fail": 1, "reject": 1})
    report = outbox.poller().run_once()
    assert sorted(report.published) == old and report.dead_lettered == [dead_old], report

    clock.set(now - timedelta(hours=2))
    parked = enqueue("invoice.due", {"fail": 1})
    report = outbox.poller(max_retries=5, backoff=timedelta(days=1)).run_once()
    assert report.retried == [parked], report

    clock.set(now - timedelta(hours=1))
    new = [enqueue("order.placed", {"n": 3})]
    dead_new = enqueue("invoice.due", {"fail": 1})
    report = outbox.poller().run_once()
    assert report.published == new and report.dead_lettered == [dead_new], report

    clock.set(now - timedelta(minutes=1))
    due = [enqueue("order.placed", {"n": 4}), enqueue("order.placed", {"n": 5})]
    return Seeded(now, old, new, dead_old, dead_new, parked, due)
