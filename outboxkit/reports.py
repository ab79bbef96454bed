"""How a poller reports what happened: the ``Delivery`` of each handler run, the log line and the
observer event of each run, settlement, unrouted event and lost lease.

A ``Reporter`` is given what it needs (the observers, the handler-scope plugins, the clocks);
it takes no ``Outbox``. Both pollers report through one, alike by construction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from .core.batch import EventRun, Settled
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
    ObserverEvent,
    Outcome,
    Published,
    RetryScheduled,
    Unrouted,
    make_delivery,
)
from .core.text import describe_exception
from .errors import LeaseLostError

if TYPE_CHECKING:
    import pluggy

    from .bus import HandlerSpec
    from .clock import Clock

__all__ = ["NO_SCOPE", "HandlerError", "Reporter", "delivery"]

log = logging.getLogger("outboxkit")

NO_SCOPE: AbstractContextManager[object] = nullcontext()
"""The handler scope of a run no plugin scopes: nothing to enter (the pollers skip it)."""


class HandlerError(Exception):
    """Wraps an exception a handler raised, to keep it apart from the store's own errors."""

    def __init__(self, exc: Exception) -> None:
        super().__init__(exc)
        self.exc = exc


def delivery(
    claim: Claim,
    spec: HandlerSpec,
    outcome: Outcome,
    at: datetime,
    error: str | None = None,
    exc: BaseException | None = None,
) -> Delivery:
    """One handler run, as the report keeps it."""
    event = claim.event
    # positionally, in field order (one per handler run: it counts)
    return make_delivery(event.id, event.topic, spec.name, event.attempts, outcome, at, error, exc)


class Reporter:
    """Reports a poller's runs, settlements and lost leases (see the module docstring).

    Args:
        emit: sends an observer event to every observer (``Outbox.emit``).
        plugins: the outbox's plugin manager (observers and handler scopes are read from it as
            each round starts: one may be added to a running outbox).
        clock: the outbox's clock (the instants a report carries).
        local_clock: the poller's local clock (the durations observers get).
    """

    def __init__(
        self,
        emit: Callable[[ObserverEvent], None],
        plugins: pluggy.PluginManager,
        clock: Clock,
        local_clock: Clock,
    ) -> None:
        self.emit = emit
        self._plugins = plugins
        self.clock = clock
        self.local_clock = local_clock
        self.observed = False  # whether anyone observes (read once per round)
        self.scoped = False  # whether a plugin scopes handler runs (read once per round)

    def refresh(self) -> None:
        """Read, as a round starts, whether anyone observes and whether a plugin scopes runs."""
        hook = self._plugins.hook
        self.observed = bool(hook.outboxkit_on_event.get_hookimpls())
        self.scoped = bool(hook.outboxkit_handler_scope.get_hookimpls())

    # -- a round ----------------------------------------------------------------------------------

    def claimed(self, claims: Sequence[Claim]) -> None:
        """Emit ``Claimed`` for each fresh claim of a round (when anyone observes)."""
        if not self.observed:
            return
        size = len(claims)
        for position, claim in enumerate(claims):
            event = claim.event
            self.emit(
                Claimed(
                    event.id,
                    event.topic,
                    claim.attempt,
                    created_at=event.created_at,
                    batch_size=size,
                    position=position,
                )
            )

    def scope(
        self, event: Event, spec: HandlerSpec, attempt: int, batched: bool
    ) -> AbstractContextManager[object]:
        """What the ``outboxkit_handler_scope`` plugins wrap a handler's run in (a tracing
        span), ``NO_SCOPE`` without such plugins. The first plugin that answers is used."""
        if not self.scoped:
            return NO_SCOPE
        hook = self._plugins.hook.outboxkit_handler_scope
        for scope in hook(event=event, handler=spec.name, attempt=attempt, batched=batched):
            if scope is not None:
                chosen: AbstractContextManager[object] = scope
                return chosen
        return NO_SCOPE

    # -- a handler's run --------------------------------------------------------------------------

    def started(self, claim: Claim, spec: HandlerSpec) -> tuple[datetime, datetime | None]:
        """A run starts: its instant (the outbox's clock) and, when anyone observes, its local
        one (for the duration), ``HandlerStarted`` emitted."""
        at = self.clock.now()
        if not self.observed:
            return at, None
        event = claim.event
        self.emit(
            HandlerStarted(
                event.id,
                event.topic,
                spec.name,
                claim.attempt,
                created_at=event.created_at,
                started_at=at,
            )
        )
        return at, self.local_clock.now()

    def _took(self, began: datetime | None) -> timedelta | None:
        return None if began is None else self.local_clock.now() - began

    def succeeded(
        self, claim: Claim, spec: HandlerSpec, at: datetime, began: datetime | None = None
    ) -> Delivery:
        # Per event at DEBUG (a drain of 10,000 events is not 10,000 lines at INFO); the
        # runner logs a count per period at INFO.
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "event %d (%s): %s succeeded",
                claim.event.id,
                claim.event.topic,
                spec.name,
                extra=_fields(claim, spec),
            )
        if self.observed:
            event = claim.event
            self.emit(
                HandlerSucceeded(
                    event.id,
                    event.topic,
                    spec.name,
                    claim.attempt,
                    created_at=event.created_at,
                    duration=self._took(began),
                )
            )
        return delivery(claim, spec, Outcome.SUCCEEDED, at)

    def rejected(
        self,
        claim: Claim,
        spec: HandlerSpec,
        at: datetime,
        reason: str,
        began: datetime | None = None,
    ) -> Delivery:
        event = claim.event
        log.debug(
            "event %d (%s): %s rejected it: %s",
            event.id,
            event.topic,
            spec.name,
            reason,
            extra=_fields(claim, spec),
        )
        if self.observed:
            self.emit(
                HandlerRejected(
                    event.id,
                    event.topic,
                    spec.name,
                    claim.attempt,
                    reason,
                    created_at=event.created_at,
                    duration=self._took(began),
                )
            )
        return delivery(claim, spec, Outcome.REJECTED, at, reason)

    def failed(
        self,
        claim: Claim,
        spec: HandlerSpec,
        at: datetime,
        failure: Exception,
        began: datetime | None = None,
    ) -> Delivery:
        """One log line for the failure: a WARNING with the one-line error, and the traceback
        with it unless the same error was this event's last one (a retry failing again the
        same way repeats nothing: its traceback was logged with the attempt it first failed
        on)."""
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
        if self.observed:
            self.emit(
                HandlerFailed(
                    event.id,
                    event.topic,
                    spec.name,
                    claim.attempt,
                    error,
                    created_at=event.created_at,
                    duration=self._took(began),
                )
            )
        return delivery(claim, spec, outcome_of(exc), at, error, exc)

    @staticmethod
    def lost(claim: Claim, spec: HandlerSpec, at: datetime) -> Delivery:
        """The lease was lost under the handler: nothing of its run was recorded."""
        return delivery(claim, spec, Outcome.LEASE_LOST, at, "lease lost")

    def relayed(self, claim: Claim, spec: HandlerSpec, answer: Exception | None) -> Delivery:
        """A relay's delivery of one event from what became of it: recorded, lost, or failed
        with the broker's answer; reported like any handler's run."""
        at, began = self.started(claim, spec)
        if answer is None:
            return self.succeeded(claim, spec, at, began)
        if isinstance(answer, LeaseLostError):
            return self.lost(claim, spec, at)
        return self.failed(claim, spec, at, answer, began)

    # -- what became of events --------------------------------------------------------------------

    def unrouted(self, run: EventRun) -> None:
        """R9: log and emit an event no handler is subscribed to (it is published at once)."""
        if isinstance(run.plan, SettleNow) and run.plan.unrouted:
            event = run.claim.event
            log.info(
                "event %d: no handler subscribed to %r; publishing it",
                event.id,
                event.topic,
                extra=_fields(run.claim, None),
            )
            self.emit(Unrouted(event.id, event.topic, created_at=event.created_at))

    def announce(self, settled: Sequence[Settled]) -> None:
        """Log and emit settlements that have been committed (the events built only when
        someone observes; the log lines always)."""
        observed = self.observed
        for claim, settlement, error in settled:
            event = claim.event
            created_at = event.created_at
            if isinstance(settlement, Publish):
                if observed:
                    self.emit(
                        Published(event.id, event.topic, claim.attempt, created_at=created_at)
                    )
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
                    self.emit(
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
                    self.emit(
                        DeadLettered(
                            event.id, event.topic, claim.attempt, error, created_at=created_at
                        )
                    )

    def lease_lost(self, claim: Claim, handler: str | None) -> None:
        event = claim.event
        log.warning(
            "event %d (%s): lease lost on attempt %d; another poller may own it",
            event.id,
            event.topic,
            claim.attempt,
            extra={**_fields(claim, None), "handler": handler},
        )
        self.emit(
            LeaseLost(event.id, event.topic, claim.attempt, handler, created_at=event.created_at)
        )


def _fields(claim: Claim, spec: HandlerSpec | None) -> dict[str, object]:
    """The structured fields of a log line about one event (``extra=``): ``event_id``,
    ``topic``, ``handler`` (None when the line is about the event as a whole), ``attempt``."""
    return {
        "event_id": claim.event.id,
        "topic": claim.event.topic,
        "handler": None if spec is None else spec.name,
        "attempt": claim.attempt,
    }
