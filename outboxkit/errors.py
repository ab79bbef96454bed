"""The errors outboxkit raises.

Every error is an ``OutboxError``; any other exception escaping outboxkit's own code is a bug.
Driver errors are mapped into this tree at the store boundary (``raise StoreError(...) from exc``)
so callers never need to import a driver to catch them::

    OutboxError
    ├── InvalidEvent (also ValueError)         bad topic, payload, headers, key or delay; nothing written
    ├── ConfigurationError (also ValueError)   bad option, bad store URL, bad name; raised at construction
    │   ├── UnknownStore                       no store is registered for the URL's scheme
    │   └── MissingDependency (also ImportError)  a store's driver is not installed ("install outboxkit[pg]")
    ├── IllegalTransition                      the lifecycle has no such (state, transition) pair
    ├── StoreError                             the store failed (the database, not a handler)
    │   ├── StoreUnavailable                   cannot reach the database; pollers retry with backoff
    │   │   └── CannotConnect                  the server refused the connection or its credentials
    │   ├── SerializationFailure               a concurrent transaction won (40001, 40P01): retry yours
    │   └── SchemaError                        schema missing, older than this code, or newer than it
    ├── LeaseLostError                         the claim token is stale: another poller owns the event
    ├── Reject                                 raised BY a handler: a business rejection, never retried
    ├── HandlerCrashed                         a handler broke its delivery transaction (ended, reopened it)
    │   └── BatchRolledBack                    ... and with it the batch's: the batch's work so far is redone
    ├── RelayError                             a relay's message was not confirmed (nack, timeout, lost link)
    │   └── Unroutable                         nothing takes the message (no queue bound, no stream)
    └── DrainError                             the test drain hit max_rounds or unexpected handler errors
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = [
    "BatchRolledBack",
    "CannotConnect",
    "ConfigurationError",
    "DrainError",
    "HandlerCrashed",
    "IllegalTransition",
    "InvalidEvent",
    "LeaseLostError",
    "MissingDependency",
    "OutboxError",
    "Reject",
    "RelayError",
    "SchemaError",
    "SerializationFailure",
    "StoreError",
    "StoreUnavailable",
    "UnknownStore",
    "Unroutable",
    "chain",
    "migrate_hint",
]


class OutboxError(Exception):
    """The root of every error outboxkit raises."""


class InvalidEvent(OutboxError, ValueError):
    """An event could not be enqueued as given; nothing was written."""


class ConfigurationError(OutboxError, ValueError):
    """An option, URL or name is invalid. Raised at construction, naming the bad value."""


class UnknownStore(ConfigurationError):
    """No store plugin handles the URL's scheme."""


class MissingDependency(ConfigurationError, ImportError):
    """The store needs a driver that is not installed."""


class IllegalTransition(OutboxError):
    """The lifecycle has no transition ``what`` out of ``state``."""

    def __init__(self, state: object, what: str) -> None:
        self.state = state
        self.what = what
        name = getattr(state, "name", state)
        super().__init__(f"illegal transition: cannot {what} an event in state {name}")


class StoreError(OutboxError):
    """The store (its database) failed. Never a handler's fault."""


class StoreUnavailable(StoreError):
    """The database cannot be reached right now; retrying later may work."""


class CannotConnect(StoreUnavailable):
    """A connection attempt failed outright: nothing listens at the address, the credentials or
    the database name were refused. Pollers still wait it out (a server may be starting); a
    one-shot ``outboxkit`` command treats it as wrong input (exit code 2)."""


class SerializationFailure(StoreError):
    """The database rolled the transaction back because of a concurrent one: a serialization
    failure (PostgreSQL's SQLSTATE 40001, under ``REPEATABLE READ`` or ``SERIALIZABLE``, e.g.
    two transactions enqueueing the same ``dedupe_key``) or a deadlock (40P01). Nothing of the
    transaction is kept; the connection is usable again once it is rolled back.

    Retryable, but not by outboxkit: ``enqueue`` runs inside the caller's transaction, which is
    aborted now, so the caller rolls it back and runs the whole transaction again (its reads
    included: they decided what it wrote). A poller meeting one in its own transactions waits
    and polls again, as for any store failure.
    """


class SchemaError(StoreError):
    """The store's schema is missing or at a version this code does not handle."""


class LeaseLostError(OutboxError):
    """The claim token no longer owns the event; the write was refused and nothing changed."""


class Reject(OutboxError):
    """Raise from a handler to reject an event for business reasons.

    The handler's writes are rolled back, a ``rejected`` delivery record is written, and the
    handler is never called for this event again.
    """

    def __init__(self, reason: str = "rejected") -> None:
        super().__init__(reason)
        self.reason = reason


class HandlerCrashed(OutboxError):
    """A handler broke the delivery transaction it was given: it committed, rolled back,
    closed or reopened it, or left it marked for rollback (rule R17). The delivery failed:
    nothing it wrote was committed, and it is retried."""


class BatchRolledBack(HandlerCrashed):
    """A handler ended the transaction of the batch it ran in (``transaction="per_batch"``),
    and everything the batch had written in it was rolled back with its own writes.

    The delivery of that handler failed (``HandlerCrashed``); the store has begun the batch
    afresh. What the rolled-back transaction held of the batch's other deliveries is named
    here, so that the poller undoes them too: their events are handed back (the attempt
    refunded) and delivered again in a later round, so they lose nothing.

    Attributes:
        undone: ``(claim token, handler name)`` of every delivery record the rolled-back
            transaction held.
        extensions_lost: a lease extension was written in it (the leases are back where the
            claim left them).
    """

    def __init__(
        self,
        message: str,
        *,
        undone: tuple[tuple[str, str], ...] = (),
        extensions_lost: bool = False,
    ) -> None:
        super().__init__(message)
        self.undone = undone
        self.extensions_lost = extensions_lost


class RelayError(OutboxError):
    """A relay's message was not confirmed by the broker: it was refused (nack), its confirm did
    not come in time, or the connection was lost first. The event is retried like a failed
    handler's.

    Attributes:
        refused: the broker answered (a nack, no route): the connection is still good.
    """

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class Unroutable(RelayError):
    """The broker took the message but nothing consumes it: RabbitMQ returned a mandatory
    message no queue is bound for, or no JetStream stream covers the NATS subject."""

    def __init__(self, message: str) -> None:
        super().__init__(message, refused=True)


class DrainError(OutboxError):
    """The test drain could not finish: see the message for the rounds or the errors."""


def migrate_hint() -> str:
    """How a message about a missing or older schema says what to do, for operators and code."""
    return "run `outboxkit migrate` (or call migrate() on the store or outbox)"


def chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or during (``__cause__``, else
    ``__context__``), each once: where the stores look for the driver's error under a
    handler's, and where passwords are scrubbed from."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__
