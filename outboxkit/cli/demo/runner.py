"""The shop, end to end, on a SQLite file: what ``outboxkit demo`` runs.

``main`` places orders (each with its ``order.placed`` event, in one transaction), drains them
with a real poller on the real clock, and counts, per handler, what the delivery records and the
observer events say happened. Retries use a short backoff (50 ms doubling, 3 retries), so the
flaky mail server's failures are retried - and a few dead-lettered - within a second or two.
"""

from __future__ import annotations

import os
import random
import sqlite3
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from outboxkit import (
    ExponentialBackoff,
    HandlerFailed,
    ObserverEvent,
    Outbox,
    Outcome,
    PollReport,
    RetryScheduled,
    State,
    hookimpl,
    open_store,
)

from .shop import PRICES, bus, create_tables, make_outbox, place_order

__all__ = ["DEFAULT_DB", "DemoRun", "HandlerTally", "main"]

DEFAULT_DB = "outboxkit-demo.db"
MAX_RETRIES = 3
BACKOFF = ExponentialBackoff(base=0.05, max=1.0)
_MIX = (("widget", 50), ("gadget", 35), ("doohickey", 15))


@dataclass
class HandlerTally:
    """What happened to one handler's deliveries in one run.

    Attributes:
        published: deliveries that succeeded (the handler's record says ``succeeded``).
        rejected: deliveries the handler rejected (``Reject``: recorded, never retried).
        retried: failed deliveries that were tried again later.
        dead_lettered: events dead-lettered without this handler having succeeded.
    """

    published: int = 0
    rejected: int = 0
    retried: int = 0
    dead_lettered: int = 0


@dataclass
class DemoRun:
    """The outcome of :func:`main`."""

    db: Path
    store_url: str
    orders: int
    seconds: float
    published: int
    dead_lettered: int
    pending: int
    handlers: dict[str, HandlerTally] = field(default_factory=dict)


class _Retries:
    """Observer: which handler failures were followed by a retry of their event."""

    def __init__(self) -> None:
        self.failures: list[tuple[int, int, str]] = []
        self.retries: set[tuple[int, int]] = set()

    @hookimpl
    def outboxkit_on_event(self, event: ObserverEvent) -> None:
        if isinstance(event, HandlerFailed):
            self.failures.append((event.event_id, event.attempt, event.handler))
        elif isinstance(event, RetryScheduled):
            self.retries.add((event.event_id, event.attempt))

    def retried(self) -> Counter[str]:
        return Counter(h for e, a, h in self.failures if (e, a) in self.retries)


def main(
    db: str | os.PathLike[str] = DEFAULT_DB,
    *,
    orders: int = 300,
    seed: int = 7,
    progress: Callable[[int], None] | None = None,
    timeout: float = 120.0,
) -> DemoRun:
    """Run the shop on the SQLite file ``db``: place ``orders`` orders, deliver them, count.

    The file is created when missing (its directory must exist); an existing demo database is
    reused and only this run's orders are counted.

    Args:
        db: the SQLite file of the shop and its outbox.
        orders: how many orders to place (>= 1).
        seed: picks the orders (product, quantity, e-mail).
        progress: called with the number of events settled (published or dead-lettered) as
            delivery goes on; the calls add up to ``orders``.
        timeout: seconds after which an unfinished drain raises ``TimeoutError``.

    Raises:
        ValueError: ``orders`` < 1.
        outboxkit.ConfigurationError: the file cannot be used (the message says why).
        TimeoutError: delivery did not finish within ``timeout``.
    """
    if orders < 1:
        raise ValueError(f"orders must be >= 1, got {orders!r}")
    path = Path(db)
    started = time.monotonic()
    store = open_store(f"sqlite:///{path}")  # creates or migrates the outbox tables, WAL mode
    try:
        conn = sqlite3.connect(path, timeout=30)
        try:
            create_tables(conn)
            retries = _Retries()
            outbox = make_outbox(store, max_retries=MAX_RETRIES, backoff=BACKOFF, plugins=[retries])
            rng = random.Random(seed)
            products = [name for name, _ in _MIX]
            weights = [weight for _, weight in _MIX]
            event_ids: list[int] = []
            for n in range(orders):
                product = rng.choices(products, weights)[0]
                quantity = rng.randint(1, 3)
                placed = place_order(
                    outbox,
                    conn,
                    email=f"customer{n}@example.com",
                    product=product,
                    quantity=quantity,
                    total=PRICES[product] * quantity,
                )
                event_ids.append(placed.event_id)
        finally:
            conn.close()
        _drain(outbox, set(event_ids), progress, deadline=started + timeout)
        return _tally(outbox, path, store.url, event_ids, retries, time.monotonic() - started)
    finally:
        store.close()


def _drain(
    outbox: Outbox, pending: set[int], progress: Callable[[int], None] | None, *, deadline: float
) -> None:
    """Deliver until every event of ``pending`` is published or dead-lettered."""
    poller = outbox.poller(batch_size=50)

    def settle(report: PollReport) -> None:
        settled = [i for i in (*report.published, *report.dead_lettered) if i in pending]
        pending.difference_update(settled)
        if settled and progress is not None:
            progress(len(settled))

    def wait_for_retries() -> bool:
        if not pending:
            return False
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the demo's {len(pending)} last event(s) were not delivered in time"
            )
        poller.waiter.wait(0.01)  # only retries are left; they are due within a second
        return True

    poller.run_until_idle(on_idle=wait_for_retries, on_round=settle)


def _tally(
    outbox: Outbox,
    path: Path,
    store_url: str,
    event_ids: list[int],
    retries: _Retries,
    seconds: float,
) -> DemoRun:
    handlers = {spec.name: HandlerTally() for spec in bus.handlers_for("order.placed")}
    published = dead = pending = 0
    for event_id in event_ids:
        event = outbox.store.get(event_id)
        if event is None:  # pruned already: cannot happen within one run
            continue
        recorded: set[str] = set()
        for record in outbox.store.records(event_id):
            recorded.add(record.handler)
            tally = handlers.setdefault(record.handler, HandlerTally())
            if record.outcome is Outcome.SUCCEEDED:
                tally.published += 1
            elif record.outcome is Outcome.REJECTED:
                tally.rejected += 1
        if event.state is State.PUBLISHED:
            published += 1
        elif event.state is State.DEAD:
            dead += 1
            for name, tally in handlers.items():
                if name not in recorded:
                    tally.dead_lettered += 1
        else:
            pending += 1
    for name, count in retries.retried().items():
        handlers.setdefault(name, HandlerTally()).retried += count
    return DemoRun(
        db=path,
        store_url=store_url,
        orders=len(event_ids),
        seconds=seconds,
        published=published,
        dead_lettered=dead,
        pending=pending,
        handlers=handlers,
    )
