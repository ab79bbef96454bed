"""The app the CLI tests run, and events seeded in every state.

``APP_SOURCE`` is written to a module of its own per test (``cli_app_<hex>.py`` in a folder on
the import path, of the test and of its subprocesses). It opens its own store from
``CLI_TEST_STORE`` / ``CLI_TEST_STORE_OPTIONS`` and has:

- ``order.placed`` handlers ``reserve`` (succeeds), ``audit`` (rejects ``{"reject": ...}``) and
  ``mail`` (non-transactional, fails ``{"fail": ...}``), and ``invoice.due`` -> ``bill`` (fails
  ``{"fail": ...}``): what ``seed`` uses;
- ``job.run`` -> ``work`` (non-transactional): touches ``started-<event>-<pid>`` in the module's
  folder, waits for a file named ``gate`` there when the payload says ``{"block": true}`` (so a
  test decides when "mid-drain" ends, without sleeping), fails on ``{"fail": true}``, and touches
  ``done-<event>-<pid>`` when it returns.
"""

from __future__ import annotations

import importlib
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
        give_up = time.monotonic() + 120  # never hang a test run for good
        while not (HERE / "gate").exists() and time.monotonic() < give_up:
            time.sleep(0.005)
    if event.payload.get("fail"):
        raise RuntimeError("job failed")
    (HERE / f"done-{event.id}-{os.getpid()}").touch()


store = open_store(
    os.environ["CLI_TEST_STORE"], **json.loads(os.environ.get("CLI_TEST_STORE_OPTIONS") or "{}")
)
outbox = Outbox(store, bus, max_retries=5, backoff=3600)
not_an_outbox = bus
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

    def gate(self) -> None:
        """Let every blocked ``work`` handler return."""
        (self.folder / "gate").touch()

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


def write_app(folder: Path) -> App:
    folder.mkdir(parents=True, exist_ok=True)
    name = f"cli_app_{uuid.uuid4().hex[:12]}"
    (folder / f"{name}.py").write_text(APP_SOURCE, encoding="utf-8")
    importlib.invalidate_caches()
    return App(name, folder)


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
