"""outboxkit: a transactional outbox for Python.

Write an event in the same transaction as the data that produced it; pollers deliver it to every
subscribed handler, at least once, with retries, backoff and dead letters::

    from outboxkit import EventBus, Outbox, open_store

    bus = EventBus()

    @bus.handler("order.placed", name="send-receipt")
    def send_receipt(event, ctx): ...

    outbox = Outbox(open_store("sqlite:///app.db"), bus)
"""

from __future__ import annotations

from .bus import DeliveryContext, EventBus, HandlerSpec
from .clock import Clock, FrozenClock, SystemClock
from .core.backoff import ExponentialBackoff
from .core.machine import Transition
from .core.model import (
    AttemptError,
    Claim,
    Claimed,
    DeadLetter,
    DeadLettered,
    Delivery,
    DeliveryRecord,
    Event,
    HandlerFailed,
    HandlerRejected,
    HandlerStarted,
    HandlerSucceeded,
    LeaseLost,
    Migration,
    ObserverEvent,
    Outcome,
    PollReport,
    Published,
    RetryScheduled,
    State,
    Stats,
    Unrouted,
)
from .errors import (
    BatchRolledBack,
    CannotConnect,
    ConfigurationError,
    DrainError,
    HandlerCrashed,
    IllegalTransition,
    InvalidEvent,
    LeaseLostError,
    MissingDependency,
    OutboxError,
    Reject,
    RelayError,
    SchemaError,
    SerializationFailure,
    StoreError,
    StoreUnavailable,
    UnknownStore,
    Unroutable,
)
from .hookspecs import hookimpl
from .memory import MemoryStore, MemoryTransaction
from .outbox import Message, Outbox
from .plugins import open_store
from .poller import Poller
from .store import Store
from .waiter import ThreadWaiter, Waiter

__version__ = "0.1.0"

__all__ = [
    "AttemptError",
    "BatchRolledBack",
    "CannotConnect",
    "Claim",
    "Claimed",
    "Clock",
    "ConfigurationError",
    "DeadLetter",
    "DeadLettered",
    "Delivery",
    "DeliveryContext",
    "DeliveryRecord",
    "DrainError",
    "Event",
    "EventBus",
    "ExponentialBackoff",
    "FrozenClock",
    "HandlerCrashed",
    "HandlerFailed",
    "HandlerRejected",
    "HandlerSpec",
    "HandlerStarted",
    "HandlerSucceeded",
    "IllegalTransition",
    "InvalidEvent",
    "LeaseLost",
    "LeaseLostError",
    "MemoryStore",
    "MemoryTransaction",
    "Message",
    "Migration",
    "MissingDependency",
    "ObserverEvent",
    "Outbox",
    "OutboxError",
    "Outcome",
    "PollReport",
    "Poller",
    "Published",
    "Reject",
    "RelayError",
    "RetryScheduled",
    "SchemaError",
    "SerializationFailure",
    "State",
    "Stats",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "SystemClock",
    "ThreadWaiter",
    "Transition",
    "Unrouted",
    "UnknownStore",
    "Unroutable",
    "Waiter",
    "__version__",
    "hookimpl",
    "open_store",
]
