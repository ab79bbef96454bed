"""What the dashboard shows and does, without HTTP: the samples of ``stats()`` over time, the
oldest due events, dead letters, failures by handler, and the two actions (requeue, purge),
each behind the token.

Everything read comes from the same ``Outbox`` methods the ``outboxkit`` commands call; the
actions are ``Outbox.requeue`` and ``Outbox.purge(dead_ids=...)``, for dead letters only.
"""

from __future__ import annotations

import hmac
import secrets
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from ...core.model import DeadLetter, Event, State, Stats
from ...errors import ConfigurationError
from ...outbox import Outbox

__all__ = ["SCAN_LIMIT", "Dashboard", "HandlerFailures", "Sample"]

SCAN_LIMIT = 10_000
"""The most events read (lowest ids first) for the oldest-due list and the failures by handler:
the store keeps no index of them, and a page must stay cheap on a large table."""
_PAGE = 1000


@dataclass(frozen=True, slots=True)
class Sample:
    """One reading of ``stats()``, at the store's ``now``."""

    at: datetime
    pending: int
    in_flight: int
    published: int
    dead: int


@dataclass(frozen=True, slots=True)
class HandlerFailures:
    """Events whose last error names ``handler`` (``"handler: Type: message"``), among the
    events of the topics where it failed: dead, and waiting for a retry."""

    handler: str
    dead: int
    retrying: int
    events: int  # the events of those topics that were read

    @property
    def rate(self) -> float:
        """The share of those events now failing for this handler."""
        return (self.dead + self.retrying) / self.events if self.events else 0.0


class Dashboard:
    """The dashboard's data and actions over one outbox.

    Args:
        outbox: the outbox to show (its store stays the caller's to close).
        token: the secret every action needs; None generates one (``token`` reads it).
        keep: how many samples of ``stats()`` to keep for the backlog chart.
        name: what the page calls the store (default: the store's ``repr``).

    Raises:
        ConfigurationError: a token shorter than 8 characters, or ``keep`` below 2.
    """

    def __init__(
        self,
        outbox: Outbox,
        *,
        token: str | None = None,
        keep: int = 120,
        name: str | None = None,
    ) -> None:
        if token is not None and len(token) < 8:
            raise ConfigurationError("the dashboard's token must be at least 8 characters long")
        if not isinstance(keep, int) or keep < 2:
            raise ConfigurationError(f"keep must be an integer of at least 2, got {keep!r:.40}")
        self.outbox = outbox
        self.name = name if name is not None else repr(outbox.store)
        self.token = token if token is not None else secrets.token_urlsafe(24)
        self._samples: deque[Sample] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def check_token(self, given: str | None) -> bool:
        """Whether ``given`` is the token (compared in constant time)."""
        return given is not None and hmac.compare_digest(given.encode(), self.token.encode())

    # -- reading ------------------------------------------------------------------------------

    def sample(self) -> Stats:
        """Read ``stats()`` now and keep it as a sample; the stats read.

        Raises:
            StoreError: the store failed.
        """
        stats = self.outbox.stats()
        reading = Sample(
            self.outbox.now(), stats.pending, stats.claimed, stats.published, stats.dead
        )
        with self._lock:
            self._samples.append(reading)
        return stats

    @property
    def samples(self) -> list[Sample]:
        """The samples kept, oldest first."""
        with self._lock:
            return list(self._samples)

    def scan(self) -> list[Event]:
        """Up to :data:`SCAN_LIMIT` events, lowest ids first."""
        events: list[Event] = []
        after_id = 0
        while len(events) < SCAN_LIMIT and (
            page := self.outbox.store.events(after_id=after_id, limit=_PAGE)
        ):
            events.extend(page)
            after_id = page[-1].id
        return events[:SCAN_LIMIT]

    def oldest_due(self, events: list[Event], now: datetime, limit: int = 10) -> list[Event]:
        """The due events among ``events`` (pending, ``available_at <= now``, not leased),
        oldest due first."""

        def due(event: Event) -> bool:
            if event.state is not State.PENDING or event.available_at is None:
                return False
            leased = event.locked_until is not None and event.locked_until > now
            return event.available_at <= now and not leased

        ordered = sorted(filter(due, events), key=lambda e: (e.available_at, e.id))
        return ordered[:limit]

    def failures_by_handler(self, events: list[Event]) -> list[HandlerFailures]:
        """Failures by handler among ``events``, most failing first."""
        failing: dict[str, list[Event]] = {}
        for event in events:
            if event.last_error and event.state is not State.PUBLISHED:
                handler = event.last_error.split(": ", 1)[0]
                failing.setdefault(handler, []).append(event)
        by_topic: dict[str, int] = {}
        for event in events:
            by_topic[event.topic] = by_topic.get(event.topic, 0) + 1
        rows = []
        for handler, failed in failing.items():
            topics = {e.topic for e in failed}
            dead = sum(1 for e in failed if e.state is State.DEAD)
            rows.append(
                HandlerFailures(
                    handler=handler,
                    dead=dead,
                    retrying=len(failed) - dead,
                    events=sum(by_topic[t] for t in topics),
                )
            )
        return sorted(rows, key=lambda r: (-r.rate, r.handler))

    def dead_letters(self, limit: int = 50) -> list[DeadLetter]:
        """The dead letters, oldest failure first."""
        return self.outbox.dead_letters(limit=limit)

    def event(self, event_id: int) -> tuple[Event | None, DeadLetter | None]:
        """One event, and its dead letter (with delivery records) when it is dead."""
        return self.outbox.store.get(event_id), self.outbox.dead_letter(event_id)

    # -- acting -------------------------------------------------------------------------------

    def requeue(self, event_id: int) -> int:
        """Requeue one dead letter; how many were requeued (0: it was not dead)."""
        return self.outbox.requeue([event_id])

    def purge(self, event_id: int) -> int:
        """Delete one dead letter with its records; how many were deleted (0: not dead)."""
        return self.outbox.purge(dead_ids=[event_id])

    def actions(self) -> dict[str, Callable[[int], int]]:
        """The actions by name, as the forms post them."""
        return {"requeue": self.requeue, "purge": self.purge}
