"""What both poller shells do around a handler's run that is no I/O of their own: the ``ctx`` a
handler gets, which handlers a poller refuses, and how a run, a settlement or a lost lease is
reported (the ``Delivery`` record, the log line, the observer event).

``outboxkit.poller`` (blocking) and ``outboxkit.aio`` (asyncio) differ only in how they wait for
the store and the handler; everything else they do alike lives here or in ``outboxkit.core``.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol

from .bus import DeliveryContext, HandlerSpec
from .core.batch import ClaimedBatch, EventRun, Settled
from .core.machine import DeadLetter, Publish, Retry, SettleNow, outcome_of
from .core.model import (
    Claim,
    Claimed,
    DeadLettered,
    Delivery,
    Event,
    HandlerFailed,
    HandlerRejected,
    HandlerStarted,
    HandlerSucceeded,
    LeaseLost,
    NewEvent,
    Outcome,
    Published,
    RetryScheduled,
    Unrouted,
    make_delivery,
)
from .core.options import PollerOptions
from .core.payload import build_event
from .core.text import describe_exception, storable
from .errors import ConfigurationError, LeaseLostError, Reject, RelayError
from .waiter import Wakeable

if TYPE_CHECKING:
    from .outbox import Outbox
    from .store import DeliveryTransaction

__all__ = [
    "Context",
    "NO_SCOPE",
    "SessionProvider",
    "SessionScope",
    "MAX_CONCURRENCY",
    "Shell",
    "HandlerError",
    "announce",
    "async_handlers",
    "awaitable_returned",
    "check_handlers",
    "delivery",
    "failed",
    "handler_scope",
    "is_coroutine_function",
    "lease_lost",
    "lost",
    "reason_of",
    "rejected",
    "relay_answers",
    "relay_delivery",
    "relayed",
    "started",
    "succeeded",
    "unrouted",
]

log = logging.getLogger("outboxkit")

MAX_CONCURRENCY = 1_000
"""The most deliveries a poller may have in flight at once (``concurrency``)."""


class Shell:
    """What both pollers are before they differ: the options, the delivery mode checked
    against the store, the stop flag and the waiter ``stop`` wakes.

    Raises:
        ConfigurationError: ``transaction="per_batch"`` on a store without batches.
    """

    waiter: Wakeable

    def __init__(self, outbox: Outbox, options: PollerOptions, concurrency: int = 1) -> None:
        self.outbox = outbox
        self.options = options
        self._batched = options.transaction == "per_batch"
        if (
            not isinstance(concurrency, int)
            or isinstance(concurrency, bool)
            or not 1 <= concurrency <= MAX_CONCURRENCY
        ):
            raise ConfigurationError(
                f"concurrency must be an integer from 1 to {MAX_CONCURRENCY:,}, got "
                f"{concurrency!r:.40}"
            )
        if self._batched and concurrency > 1:
            raise ConfigurationError(
                "transaction='per_batch' delivers a batch in one transaction, on one connection: "
                f"it cannot deliver events at once (concurrency={concurrency}); use "
                "transaction='per_event' with concurrency"
            )
        self.concurrency = concurrency
        # Read once per round from the outbox (``_claimed``): whether anyone observes, whether
        # a plugin scopes handler runs, and what every ``ctx`` of the round is made with.
        self._observed = False
        self._scoped = False
        self._context_args: tuple[int, SessionProvider | None, HeadersFor] = (
            outbox.max_payload_bytes,
            outbox.sessions,
            outbox.headers_for,
        )
        capabilities = outbox.store.capabilities
        if self._batched and not capabilities.batches:
            raise ConfigurationError(
                f"transaction='per_batch' needs a store with batches; {outbox.store!r} has "
                f"{sorted(capabilities.names())}"
            )
        self._stop = threading.Event()
        # ``prefetch`` where others may claim while a batch or delivery is open; elsewhere a
        # prefetched claim would only wait for the batch's lock (SQLite): it claims as usual.
        self._prefetch = (
            options.prefetch
            and capabilities.concurrent_claimers
            and capabilities.concurrent_batches
        )

    def _claimed(self, claims: Sequence[Claim], claimed_at: datetime) -> ClaimedBatch:
        """The bookkeeping of a round's fresh claims (``Claimed`` emitted for each); what each
        of the round's runs needs from the outbox is read once (``_begin_run``)."""
        outbox = self.outbox
        self._observed = outbox.observed
        self._scoped = bool(outbox.plugins.hook.outboxkit_handler_scope.get_hookimpls())
        self._context_args = (outbox.max_payload_bytes, outbox.sessions, outbox.headers_for)
        options = self.options
        batch = ClaimedBatch(
            claims,
            claimed_at=claimed_at,
            lease=options.lease,
            max_retries=options.max_retries,
            backoff=options.backoff,
        )
        if self._observed:
            size = len(claims)
            for position, claim in enumerate(claims):
                event = claim.event
                outbox.emit(
                    Claimed(
                        event.id,
                        event.topic,
                        claim.attempt,
                        created_at=event.created_at,
                        batch_size=size,
                        position=position,
                    )
                )
        return batch

    def _begin_run(
        self, claim: Claim, spec: HandlerSpec
    ) -> tuple[Context, datetime, datetime | None, AbstractContextManager[object]]:
        """What both pollers do as one of ``claim``'s handlers starts: its ``ctx``, the instant
        (the outbox's clock) and the local one it started at (for the observers' durations:
        None when no one observes), ``HandlerStarted`` emitted, and what the handler scope
        plugins wrap its run in."""
        outbox = self.outbox
        attempt = claim.event.attempts
        ctx = Context(spec.name, attempt, *self._context_args)
        at = outbox.clock.now()
        began = None
        if self._observed:
            began = outbox.local_clock.now()
            started(outbox, claim, spec, at)
        scope = (
            handler_scope(outbox, claim.event, spec, attempt, self._batched)
            if self._scoped
            else NO_SCOPE
        )
        return ctx, at, began, scope

    def __repr__(self) -> str:
        o = self.options
        return (
            f"{type(self).__name__}(batch_size={o.batch_size}, "
            f"lease={o.lease.total_seconds()}s, interval={o.interval.total_seconds()}s, "
            f"max_retries={o.max_retries}, transaction={o.transaction!r}"
            f"{', prefetch=True' if o.prefetch else ''}{self._described()})"
        )

    def _described(self) -> str:
        return f", concurrency={self.concurrency}" if self.concurrency > 1 else ""

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        """Stop gracefully: finish the events in hand, release the leases of the rest (safe
        from any thread and from a signal handler)."""
        self._stop.set()
        self.waiter.wake()


class SessionScope(Protocol):
    """One delivery's ``ctx.session``, made on the handler's first use of it (an ORM
    integration's; see ``outboxkit.contrib.sqlalchemy.use_sessions``)."""

    @property
    def session(self) -> Any:
        """What ``ctx.session`` is."""
        ...

    def finish(self) -> Any:
        """After the handler returned, before the delivery record: write what the session
        holds (a flush). An awaitable for an asyncio delivery, else None."""
        ...

    def close(self) -> Any:
        """After ``finish`` or a failure: let go of the session, never ending the delivery
        transaction. An awaitable for an asyncio delivery, else None."""
        ...


class SessionProvider(Protocol):
    """What ``Outbox.sessions`` holds: makes the ``ctx.session`` of one delivery."""

    def open(self, connection: Any) -> SessionScope:
        """A scope bound to ``connection``, the delivery transaction's connection.

        Raises:
            ConfigurationError: ``connection`` is not one the provider can bind a session to.
        """
        ...


HeadersFor = Callable[[str, Mapping[str, str] | None], Mapping[str, str] | None]
"""``Outbox.headers_for``: a follow-up's headers with what the enqueue plugins add."""


class Context:
    """The ``ctx`` a handler receives (see ``outboxkit.bus.DeliveryContext``).

    ``connection`` is the delivery transaction's connection (None for a non-transactional
    handler): the one the shell set, or (``bind``) the delivery transaction's, taken only when
    the handler asks for it (a store may open the transaction then: a handler that never uses
    it costs no round trip). A follow-up ``enqueue`` is written at once through ``write`` when
    the shell gives one (a blocking transactional delivery), else kept in ``buffer`` and written
    by the shell with the delivery record, in the same transaction.

    ``session`` is made on first use by the outbox's ``SessionProvider`` (``sessions``), bound
    to ``connection`` (taking it, so opening the delivery transaction); ``scope`` is then set,
    and the shell finishes and closes it around the record. A handler that never touches
    ``session`` costs nothing more.
    """

    __slots__ = (
        "_connection",
        "_headers",
        "_max_payload_bytes",
        "_tx",
        "attempt",
        "buffer",
        "handler",
        "scope",
        "sessions",
        "write",
    )

    def __init__(
        self,
        handler: str,
        attempt: int,
        max_payload_bytes: int,
        sessions: SessionProvider | None = None,
        headers: HeadersFor | None = None,
    ) -> None:
        self.handler = handler
        self._headers = headers
        self.attempt = attempt
        self._max_payload_bytes = max_payload_bytes
        self._connection: Any = None
        self._tx: DeliveryTransaction | None = None
        self.write: Callable[[Sequence[NewEvent]], object] | None = None
        self.buffer: list[NewEvent] = []
        self.sessions = sessions
        self.scope: SessionScope | None = None

    @property
    def session(self) -> Any:
        """An ORM session in the delivery transaction (see ``SessionProvider``): its writes
        commit with the delivery record and roll back with a failure or a ``Reject``.

        Raises:
            ConfigurationError: the outbox has no session provider, or the handler is not
                transactional (it has no delivery transaction to bind a session to).
        """
        scope = self.scope
        if scope is None:
            if self.sessions is None:
                raise ConfigurationError(
                    f"ctx.session in handler {self.handler!r}: this outbox has no session "
                    "provider; call outboxkit.contrib.sqlalchemy.use_sessions(outbox, "
                    "sessionmaker) first"
                )
            if self.connection is None:
                raise ConfigurationError(
                    f"ctx.session in handler {self.handler!r}: a non-transactional handler "
                    "has no delivery transaction to write in; subscribe it with "
                    "transactional=True"
                )
            scope = self.scope = self.sessions.open(self.connection)
        return scope.session

    @property
    def connection(self) -> Any:
        tx = self._tx
        return self._connection if tx is None else tx.connection

    @connection.setter
    def connection(self, value: Any) -> None:
        self._connection = value

    def bind(self, tx: DeliveryTransaction) -> None:
        """Hand the handler ``tx``: its connection on demand, its follow-ups written at once."""
        self._tx, self.write = tx, tx.enqueue

    def enqueue(
        self,
        topic: str,
        payload: Any,
        *,
        headers: Mapping[str, str] | None = None,
        key: str | None = None,
        delay: float | timedelta | None = None,
    ) -> None:
        if self._headers is not None:
            headers = self._headers(topic, headers)
        event = build_event(
            topic,
            payload,
            headers=headers,
            key=key,
            delay=delay,
            max_payload_bytes=self._max_payload_bytes,
        )
        if self.write is not None:
            self.write([event])
        else:
            self.buffer.append(event)


class HandlerError(Exception):
    """Wraps an exception a handler raised, to keep it apart from the store's own errors."""

    def __init__(self, exc: Exception) -> None:
        super().__init__(exc)
        self.exc = exc


def is_coroutine_function(fn: object) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def async_handlers(specs: Sequence[HandlerSpec]) -> list[HandlerSpec]:
    """The ``async def`` handlers among ``specs``, in order: a bus with any of them needs the
    asyncio poller (the test kit's drain and ``outboxkit run`` choose it by this).

    Args:
        specs: the subscriptions of a bus (``EventBus.specs()``).

    Returns:
        The subscriptions whose handler is an ``async def`` function (or callable object).
    """
    return [spec for spec in specs if is_coroutine_function(spec.fn)]


def check_handlers(specs: Sequence[HandlerSpec], *, asyncio: bool) -> None:
    """Refuse handlers a poller cannot run, naming them: an ``async def`` handler under the
    blocking poller (its coroutine would never be awaited), or (``asyncio``) a blocking
    transactional handler under the asyncio poller (it would block the event loop while it
    holds its delivery transaction).

    Raises:
        ConfigurationError: naming the handler and its topic.
    """
    for spec in specs:
        coroutine = is_coroutine_function(spec.fn)
        if coroutine and not asyncio:
            raise ConfigurationError(
                f"handler {spec.name!r} (topic {spec.topic!r}) is an async def: the blocking "
                "poller cannot await it; run it with outbox.async_poller()"
            )
        if asyncio and not coroutine and spec.transactional:
            raise ConfigurationError(
                f"handler {spec.name!r} (topic {spec.topic!r}) is a blocking transactional "
                "handler: the asyncio poller runs only async def transactional handlers (a "
                "blocking one would hold the event loop in its delivery transaction); make it "
                "async def, subscribe it with transactional=False, or use outbox.poller()"
            )


def awaitable_returned(spec: HandlerSpec, result: object) -> HandlerError:
    """The failure of a handler that returned an awaitable to the blocking poller: it is never
    recorded as run without running (its coroutine, if it is one, is closed unawaited)."""
    if inspect.iscoroutine(result):
        result.close()  # no "never awaited" warning: it is reported here instead
    return HandlerError(
        TypeError(
            f"handler {spec.name!r} returned {type(result).__name__}, an awaitable: the "
            "blocking poller cannot await it; run async handlers with outbox.async_poller()"
        )
    )


# -- relays ---------------------------------------------------------------------------------------


def relay_answers(spec: HandlerSpec, count: int, answers: object) -> list[Exception | None]:
    """What ``spec``'s relay answered for ``count`` events, checked: anything but a list of
    ``count`` entries, each ``None`` or an ``Exception``, fails every event, naming it (a
    relay's bug is never recorded as a delivery)."""
    if (
        isinstance(answers, list)
        and len(answers) == count
        and all(a is None or isinstance(a, Exception) for a in answers)
    ):
        return answers
    failure = RelayError(
        f"relay {spec.name!r} answered {type(answers).__name__} for {count} event(s); "
        "publish must return one None or Exception per event"
    )
    return [failure] * count


def relay_delivery(
    outbox: Outbox, claim: Claim, spec: HandlerSpec, answer: Exception | None
) -> Delivery:
    """A relay's delivery of one event from what became of it (``ClaimedBatch.relay_result``): recorded,
    lost, or failed with the broker's answer; reported like any handler's run. (A ``Reject``
    is recorded by the shell's own delivery path first.)"""
    at = outbox.clock.now()
    started(outbox, claim, spec, at)
    if answer is None:
        return succeeded(outbox, claim, spec, at)
    if isinstance(answer, LeaseLostError):
        return lost(claim, spec, at)
    return failed(outbox, claim, spec, at, answer)


def relayed(spec: HandlerSpec, answer: Exception | None, *, asyncio: bool) -> HandlerSpec:
    """A relay's subscription as a handler whose run is the broker's ``answer`` for one event:
    a confirm returns, anything else is raised; the shell then records it as any
    non-transactional handler's run."""

    def confirmed(event: Event, ctx: DeliveryContext) -> None:
        if answer is not None:
            raise answer

    async def confirmed_async(event: Event, ctx: DeliveryContext) -> None:
        confirmed(event, ctx)

    return dataclasses.replace(spec, fn=confirmed_async if asyncio else confirmed)


# -- what a handler's run was ---------------------------------------------------------------------


def delivery(
    claim: Claim,
    spec: HandlerSpec,
    outcome: Outcome,
    at: datetime,
    error: str | None = None,
    exc: BaseException | None = None,
) -> Delivery:
    event = claim.event
    # positionally, in field order (one per handler run: it counts)
    return make_delivery(event.id, event.topic, spec.name, event.attempts, outcome, at, error, exc)


def started(outbox: Outbox, claim: Claim, spec: HandlerSpec, at: datetime) -> None:
    """Emit ``HandlerStarted`` (built only when someone observes)."""
    if outbox.observed:
        event = claim.event
        outbox.emit(
            HandlerStarted(
                event.id,
                event.topic,
                spec.name,
                claim.attempt,
                created_at=event.created_at,
                started_at=at,
            )
        )


NO_SCOPE: AbstractContextManager[object] = nullcontext()
"""The handler scope of a run no plugin scopes: nothing to enter (the shells skip it)."""


def handler_scope(
    outbox: Outbox, event: Event, spec: HandlerSpec, attempt: int, batched: bool
) -> AbstractContextManager[object]:
    """What the ``outboxkit_handler_scope`` plugins wrap a handler's run in (a tracing span):
    nothing at all without such plugins. The first plugin that answers is used."""
    hook = outbox.plugins.hook.outboxkit_handler_scope
    if not hook.get_hookimpls():
        return NO_SCOPE
    for scope in hook(event=event, handler=spec.name, attempt=attempt, batched=batched):
        if scope is not None:
            chosen: AbstractContextManager[object] = scope
            return chosen
    return NO_SCOPE


def _took(outbox: Outbox, began: datetime | None) -> timedelta | None:
    return None if began is None else outbox.local_clock.now() - began


def succeeded(
    outbox: Outbox, claim: Claim, spec: HandlerSpec, at: datetime, began: datetime | None = None
) -> Delivery:
    event = claim.event
    if outbox.observed:
        outbox.emit(
            HandlerSucceeded(
                event.id,
                event.topic,
                spec.name,
                claim.attempt,
                created_at=event.created_at,
                duration=_took(outbox, began),
            )
        )
    return delivery(claim, spec, Outcome.SUCCEEDED, at)


def rejected(
    outbox: Outbox,
    claim: Claim,
    spec: HandlerSpec,
    at: datetime,
    reason: str,
    began: datetime | None = None,
) -> Delivery:
    event = claim.event
    log.info(
        "event %d (%s): %s rejected it: %s",
        event.id,
        event.topic,
        spec.name,
        reason,
        extra=_fields(claim, spec),
    )
    if outbox.observed:
        outbox.emit(
            HandlerRejected(
                event.id,
                event.topic,
                spec.name,
                claim.attempt,
                reason,
                created_at=event.created_at,
                duration=_took(outbox, began),
            )
        )
    return delivery(claim, spec, Outcome.REJECTED, at, reason)


def failed(
    outbox: Outbox,
    claim: Claim,
    spec: HandlerSpec,
    at: datetime,
    failure: Exception,
    began: datetime | None = None,
) -> Delivery:
    """One log line for the failure: a WARNING with the one-line error, and the traceback with
    it unless the same error was this event's last one (a retry failing again the same way
    repeats nothing: its traceback was logged with the attempt it first failed on)."""
    exc: Exception = failure.exc if isinstance(failure, HandlerError) else failure
    error = describe_exception(exc)
    event = claim.event
    repeated = event.last_error is not None and f"{spec.name}: {error}" in event.last_error
    log.warning(
        "event %d (%s): handler %s failed on attempt %d: %s%s",
        event.id,
        event.topic,
        spec.name,
        claim.attempt,
        error,
        " (as on the last attempt)" if repeated else "",
        exc_info=None if repeated else exc,
        extra=_fields(claim, spec),
    )
    if outbox.observed:
        outbox.emit(
            HandlerFailed(
                event.id,
                event.topic,
                spec.name,
                claim.attempt,
                error,
                created_at=event.created_at,
                duration=_took(outbox, began),
            )
        )
    return delivery(claim, spec, outcome_of(exc), at, error, exc)


def _fields(claim: Claim, spec: HandlerSpec | None) -> dict[str, object]:
    """The structured fields of a log line about one event (``extra=``): ``event_id``,
    ``topic``, ``handler`` (None when the line is about the event as a whole), ``attempt``."""
    return {
        "event_id": claim.event.id,
        "topic": claim.event.topic,
        "handler": None if spec is None else spec.name,
        "attempt": claim.attempt,
    }


def lost(claim: Claim, spec: HandlerSpec, at: datetime) -> Delivery:
    """The lease was lost under the handler: nothing of its run was recorded."""
    return delivery(claim, spec, Outcome.CRASHED, at, "lease lost")


def reason_of(rejection: Reject) -> str:
    """A ``Reject``'s reason, storable (see ``core.text.storable``)."""
    return storable(rejection.reason)


# -- what became of events ------------------------------------------------------------------------


def unrouted(outbox: Outbox, run: EventRun) -> None:
    """R9: log and emit an event no handler is subscribed to (it is published at once)."""
    if isinstance(run.plan, SettleNow) and run.plan.unrouted:
        event = run.claim.event
        log.info(
            "event %d: no handler subscribed to %r; publishing it",
            event.id,
            event.topic,
            extra=_fields(run.claim, None),
        )
        outbox.emit(Unrouted(event.id, event.topic, created_at=event.created_at))


def announce(outbox: Outbox, settled: Sequence[Settled]) -> None:
    """Log and emit settlements that have been committed (the events built only when someone
    observes; the log lines always)."""
    observed = outbox.observed
    for claim, settlement, error in settled:
        event = claim.event
        created_at = event.created_at
        if isinstance(settlement, Publish):
            if observed:
                outbox.emit(Published(event.id, event.topic, claim.attempt, created_at=created_at))
        elif isinstance(settlement, Retry):
            log.info(
                "event %d (%s): retry %d in %ss",
                event.id,
                event.topic,
                settlement.retry,
                settlement.delay.total_seconds(),
                extra=_fields(claim, None),
            )
            if observed:
                outbox.emit(
                    RetryScheduled(
                        event.id,
                        event.topic,
                        claim.attempt,
                        settlement.delay,
                        error,
                        created_at=created_at,
                    )
                )
        elif isinstance(settlement, DeadLetter):
            log.warning(
                "event %d (%s): dead-lettered after %d attempt(s): %s",
                event.id,
                event.topic,
                claim.attempt,
                error,
                extra=_fields(claim, None),
            )
            if observed:
                outbox.emit(
                    DeadLettered(event.id, event.topic, claim.attempt, error, created_at=created_at)
                )


def lease_lost(outbox: Outbox, claim: Claim, handler: str | None) -> None:
    log.warning(
        "event %d (%s): lease lost on attempt %d; another poller may own it",
        claim.event.id,
        claim.event.topic,
        claim.attempt,
        extra={**_fields(claim, None), "handler": handler},
    )
    event = claim.event
    outbox.emit(
        LeaseLost(event.id, event.topic, claim.attempt, handler, created_at=event.created_at)
    )
