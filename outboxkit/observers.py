"""Ready-made observers: plugins implementing ``outboxkit_on_event``.

Register one on an outbox (``outbox.add_observer(LoggingObserver())``), pass it in
``Outbox(..., plugins=[...])``, or expose it through the ``outboxkit`` entry point.
"""

from __future__ import annotations

import logging

from .core.model import (
    Claimed,
    DeadLettered,
    HandlerFailed,
    HandlerRejected,
    HandlerStarted,
    HandlerSucceeded,
    LeaseLost,
    ObserverEvent,
    Published,
    RetryScheduled,
    Unrouted,
)
from .hookspecs import hookimpl

__all__ = ["DEFAULT_LEVELS", "LoggingObserver"]

DEFAULT_LEVELS: dict[type[ObserverEvent], int] = {
    Claimed: logging.DEBUG,
    HandlerStarted: logging.DEBUG,
    HandlerSucceeded: logging.DEBUG,
    Published: logging.DEBUG,
    HandlerRejected: logging.INFO,
    Unrouted: logging.INFO,
    RetryScheduled: logging.INFO,
    HandlerFailed: logging.WARNING,
    LeaseLost: logging.WARNING,
    DeadLettered: logging.ERROR,
}
"""The level each observer event is logged at: the routine ones (claims, handler starts,
successes, publishes) at DEBUG, a business rejection
or a scheduled retry at INFO, a handler failure or a lost lease at WARNING, a dead letter at
ERROR. An event type not listed (a newer one) is logged at INFO."""


class LoggingObserver:
    """Logs every observer event, one line each, under the ``outboxkit.events`` logger.

    The event object rides along as ``record.outboxkit_event`` (``extra``), for structured
    log handlers.

    Args:
        logger: where to log (default ``logging.getLogger("outboxkit.events")``).
        levels: overrides of :data:`DEFAULT_LEVELS`, by event type.
    """

    def __init__(
        self,
        logger: logging.Logger | None = None,
        *,
        levels: dict[type[ObserverEvent], int] | None = None,
    ) -> None:
        self.logger = logger if logger is not None else logging.getLogger("outboxkit.events")
        self.levels = {**DEFAULT_LEVELS, **(levels or {})}

    def __repr__(self) -> str:
        return f"LoggingObserver({self.logger.name!r})"

    @hookimpl
    def outboxkit_on_event(self, event: ObserverEvent) -> None:
        level = self.levels.get(type(event), logging.INFO)
        if self.logger.isEnabledFor(level):
            self.logger.log(level, "%s", describe(event), extra={"outboxkit_event": event})


def describe(event: ObserverEvent) -> str:
    """One human line for an observer event."""
    head = f"event {event.event_id} ({event.topic})"
    if isinstance(event, Claimed):
        return f"{head}: claimed, attempt {event.attempt}"
    if isinstance(event, HandlerStarted):
        return f"{head}: {event.handler} started on attempt {event.attempt}"
    if isinstance(event, HandlerSucceeded):
        return f"{head}: {event.handler} succeeded on attempt {event.attempt}"
    if isinstance(event, HandlerRejected):
        return f"{head}: {event.handler} rejected it on attempt {event.attempt}: {event.reason}"
    if isinstance(event, HandlerFailed):
        return f"{head}: {event.handler} failed on attempt {event.attempt}: {event.error}"
    if isinstance(event, RetryScheduled):
        return (
            f"{head}: attempt {event.attempt} failed, retry in "
            f"{event.delay.total_seconds():g}s: {event.error}"
        )
    if isinstance(event, Published):
        return f"{head}: published after {event.attempt} attempt(s)"
    if isinstance(event, Unrouted):
        return f"{head}: no handler subscribed; published"
    if isinstance(event, DeadLettered):
        return f"{head}: dead-lettered after {event.attempt} attempt(s): {event.error}"
    if isinstance(event, LeaseLost):
        during = f" during {event.handler}" if event.handler else ""
        return f"{head}: lease lost on attempt {event.attempt}{during}"
    return f"{head}: {type(event).__name__}"
