"""The example shop: a small order service built on outboxkit, what ``outboxkit demo`` runs.

An order is written together with its ``order.placed`` event, in one SQLite transaction. Three
handlers react to it:

- ``reserve-stock`` (transactional): takes the quantity off the ``stock`` table, in the delivery
  transaction, so stock is reserved exactly once however often delivery is retried;
- ``fraud-check`` (transactional): rejects orders over the fraud limit - a business decision,
  recorded and never retried;
- ``send-receipt`` (non-transactional): calls a flaky mail server that fails now and then; the
  retry with backoff gets the receipt out.

    from outboxkit.cli.demo.shop import create_tables, make_outbox, place_order

``outboxkit.cli.demo.runner.main`` runs it end to end (``outboxkit demo``);
``outboxkit.cli.demo.app`` is the same outbox as an app module, for
``outboxkit run outboxkit.cli.demo.app:outbox``.
"""

from __future__ import annotations

import random
import sqlite3
import threading
from dataclasses import dataclass, field
from typing import Any

from outboxkit import Event, EventBus, Outbox, Reject, Store
from outboxkit.bus import DeliveryContext

__all__ = [
    "FRAUD_LIMIT",
    "PRICES",
    "PRODUCTS",
    "FlakyMailer",
    "Placed",
    "bus",
    "create_tables",
    "make_outbox",
    "mailer",
    "place_order",
]

FRAUD_LIMIT = 5_000
PRODUCTS = {"widget": 1_000, "gadget": 1_000, "doohickey": 60}
"""Each product and its starting stock."""
PRICES = {"widget": 20, "gadget": 150, "doohickey": 2_400}


@dataclass
class FlakyMailer:
    """A fake mail server that fails now and then, and records the receipts it accepted.

    Whether a call fails depends only on ``(seed, order_id, attempt)``, never on the order the
    calls come in, so a run's outcome is the same however the pollers interleave: a call
    fails when ``attempt <= fail_first``, or with probability ``failure_rate``.
    """

    failure_rate: float = 0.3
    fail_first: int = 0
    seed: int = 7
    sent: list[int] = field(default_factory=list)
    calls: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def fails(self, order_id: int, attempt: int) -> bool:
        """Whether the call for ``order_id`` on ``attempt`` fails."""
        if attempt <= self.fail_first:
            return True
        draw = random.Random(f"{self.seed}:{order_id}:{attempt}").random()
        return draw < self.failure_rate

    def send(self, order_id: int, email: str, *, attempt: int = 1) -> None:
        with self._lock:
            self.calls += 1
        if self.fails(order_id, attempt):
            raise ConnectionError(f"mail server busy (order {order_id})")
        with self._lock:
            self.sent.append(order_id)


mailer = FlakyMailer()
bus = EventBus()


@bus.handler("order.placed", name="fraud-check")
def fraud_check(event: Event, ctx: DeliveryContext) -> None:
    """Reject orders whose total is over the fraud limit."""
    if event.payload["total"] > FRAUD_LIMIT:
        raise Reject(f"total {event.payload['total']} is over the fraud limit {FRAUD_LIMIT}")


@bus.handler("order.placed", name="reserve-stock")
def reserve_stock(event: Event, ctx: DeliveryContext) -> None:
    """Take the ordered quantity off the stock, in the delivery transaction (exactly once)."""
    order = event.payload
    cursor = ctx.connection.execute(
        "UPDATE stock SET available = available - ? WHERE product = ? AND available >= ?",
        (order["quantity"], order["product"], order["quantity"]),
    )
    if cursor.rowcount != 1:
        raise Reject(f"out of stock: {order['product']}")


@bus.handler("order.placed", name="send-receipt", transactional=False)
def send_receipt(event: Event, ctx: DeliveryContext) -> None:
    """Mail a receipt through the flaky mail server (outside any transaction)."""
    mailer.send(event.payload["order_id"], event.payload["email"], attempt=ctx.attempt)


def create_tables(conn: sqlite3.Connection) -> None:
    """The shop's own tables (orders, stock), next to the outbox's in the same file."""
    conn.execute(
        "CREATE TABLE IF NOT EXISTS orders ("
        " id INTEGER PRIMARY KEY, email TEXT NOT NULL, product TEXT NOT NULL,"
        " quantity INTEGER NOT NULL, total INTEGER NOT NULL)"
    )
    conn.execute(
        "CREATE TABLE IF NOT EXISTS stock (product TEXT PRIMARY KEY, available INTEGER NOT NULL)"
    )
    conn.executemany(
        "INSERT OR IGNORE INTO stock (product, available) VALUES (?, ?)", PRODUCTS.items()
    )
    conn.commit()


def make_outbox(store: Store, **options: Any) -> Outbox:
    """The shop's outbox on ``store`` (a SQLite store on the shop's database file)."""
    return Outbox(store, bus, **options)


@dataclass(frozen=True)
class Placed:
    """An order that was placed, and the id of its ``order.placed`` event."""

    order_id: int
    event_id: int


def place_order(
    outbox: Outbox,
    conn: sqlite3.Connection,
    *,
    email: str,
    product: str,
    quantity: int,
    total: int | None = None,
) -> Placed:
    """Write the order and its ``order.placed`` event in one transaction.

    ``total`` defaults to ``quantity`` times the product's price.
    """
    if total is None:
        total = PRICES[product] * quantity
    with conn:  # the app's own transaction: both rows commit, or neither does
        cursor = conn.execute(
            "INSERT INTO orders (email, product, quantity, total) VALUES (?, ?, ?, ?)",
            (email, product, quantity, total),
        )
        order_id = int(cursor.lastrowid or 0)
        event_id = outbox.enqueue(
            conn,
            "order.placed",
            {
                "order_id": order_id,
                "email": email,
                "product": product,
                "quantity": quantity,
                "total": total,
            },
        )
    return Placed(order_id, event_id)
