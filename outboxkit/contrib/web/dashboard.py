"""What the dashboard shows and does, without HTTP: the samples of ``stats()`` over time, a
survey of the events (the oldest due, failures by handler), events and dead letters page by
page (keyset, with filters), the keys dead events hold, sign-in sessions, and the actions
(requeue, purge: one dead letter, or every one a filter matches, after a preview).

Memory stays bounded whatever the payloads: every read is a small page (``READ_PAGE`` events),
and nothing keeps more than the rows a page shows (the survey keeps the oldest due events it
shows and counts). Everything read comes from the same ``Outbox`` methods the ``outboxkit``
commands call; the actions are ``Outbox.requeue`` and ``Outbox.purge(dead_ids=...)``, for dead
letters only.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from ...core.model import AttemptError, DeadKey, DeadLetter, Event, State, Stats
from ...errors import ConfigurationError
from ...outbox import Outbox
from ...reading import DeadEventKey, dead_keys, iter_dead_letters

__all__ = [
    "BULK_LIMIT",
    "PAGE_ROWS",
    "READ_PAGE",
    "SCAN_BUDGET",
    "Dashboard",
    "EventFilter",
    "HandlerFailures",
    "Sample",
    "Survey",
]

READ_PAGE = 10
"""Events per store read: with payloads of up to 1 MiB, a read holds at most this many MiB."""
PAGE_ROWS = 25
"""Rows a list page shows."""
SCAN_BUDGET = 5_000
"""The most events one page reads looking for matches (a page then offers to go on)."""
BULK_LIMIT = 10_000
"""The most dead letters one bulk action changes (the preview says when more match)."""
SESSION_HOURS = 12


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


@dataclass(frozen=True, slots=True)
class EventFilter:
    """What a list page shows: a state (``due``, ``pending``, ``in_flight``, ``published``,
    ``dead``), a topic, a key, text in the last error, and a least age (since created)."""

    state: str = ""
    topic: str = ""
    key: str = ""
    error: str = ""
    older_than: timedelta | None = None

    STATES = ("", "due", "pending", "in_flight", "published", "dead")

    def matches(self, event: Event, now: datetime) -> bool:
        if self.topic and event.topic != self.topic:
            return False
        if self.key and event.key != self.key:
            return False
        if self.error and self.error.lower() not in (event.last_error or "").lower():
            return False
        if self.older_than is not None and (
            event.created_at is None or now - event.created_at < self.older_than
        ):
            return False
        return (
            not self.state
            or _state_name(event, now) == self.state
            or (self.state == "pending" and _state_name(event, now) == "due")
        )


def _state_name(event: Event, now: datetime) -> str:
    if event.state is State.PUBLISHED:
        return "published"
    if event.state is State.DEAD:
        return "dead"
    if event.locked_until is not None and event.locked_until > now:
        return "in_flight"
    if event.available_at is not None and event.available_at <= now:
        return "due"
    return "pending"


@dataclass
class Survey:
    """One pass over the events, keyset, ``READ_PAGE`` at a time, up to a budget: the oldest
    due events (at most ``show``) and failures by handler, nothing else kept."""

    scanned: int = 0
    first_id: int = 0  # read after this id
    last_id: int = 0
    complete: bool = True
    due: list[Event] = field(default_factory=list)
    failures: list[HandlerFailures] = field(default_factory=list)


@dataclass
class _Session:
    created: float
    who: str


class Dashboard:
    """The dashboard's data and actions over one outbox.

    Args:
        outbox: the outbox to show (its store stays the caller's to close).
        token: the secret signing in needs; None generates one (``token`` reads it).
        keep: how many samples of ``stats()`` to keep for the backlog chart.
        name: what the page calls the store (default: the store's ``repr``).
        policy_known: whether ``outbox.dead_key`` is the app's (``outboxkit web --app``), so
            that held keys are called held; False states the policy unknown.

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
        policy_known: bool = True,
    ) -> None:
        if token is not None and len(token) < 8:
            raise ConfigurationError("the dashboard's token must be at least 8 characters long")
        if not isinstance(keep, int) or keep < 2:
            raise ConfigurationError(f"keep must be an integer of at least 2, got {keep!r:.40}")
        self.outbox = outbox
        self.name = name if name is not None else repr(outbox.store)
        self.token = token if token is not None else secrets.token_urlsafe(24)
        self.policy: DeadKey | None = outbox.dead_key if policy_known else None
        self._samples: deque[Sample] = deque(maxlen=keep)
        self._sessions: dict[str, _Session] = {}
        # Below this id every event was published when last surveyed: published is final, so
        # the next survey starts there (a long history is read once, not on every refresh).
        self._survey_from = 0
        self._lock = threading.Lock()

    def check_token(self, given: str | None) -> bool:
        """Whether ``given`` is the token (compared in constant time)."""
        return given is not None and hmac.compare_digest(given.encode(), self.token.encode())

    # -- sessions -----------------------------------------------------------------------------

    def sign_in(self, token: str | None, who: str) -> str | None:
        """A new session id for the right token (None for a wrong one)."""
        if not self.check_token(token):
            return None
        session = secrets.token_urlsafe(32)
        with self._lock:
            self._forget_old()
            self._sessions[session] = _Session(time.monotonic(), who)
        return session

    def session(self, session: str | None) -> str | None:
        """A short name of a live session (for the log), or None."""
        if not session:
            return None
        with self._lock:
            self._forget_old()
            for known in self._sessions:
                if hmac.compare_digest(known.encode(), session.encode()):
                    return f"session {known[:6]} ({self._sessions[known].who})"
        return None

    def sign_out(self, session: str | None) -> None:
        with self._lock:
            if session:
                self._sessions.pop(session, None)

    def _forget_old(self) -> None:
        limit = time.monotonic() - SESSION_HOURS * 3600
        for known in [k for k, v in self._sessions.items() if v.created < limit]:
            del self._sessions[known]

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

    def _events(self, after_id: int, topic: str | None = None) -> Iterator[Event]:
        """Events with ``id > after_id`` in id order, read ``READ_PAGE`` at a time."""
        while page := self.outbox.store.events(after_id=after_id, topic=topic, limit=READ_PAGE):
            yield from page
            after_id = page[-1].id
            del page  # one page at a time: its payloads go before the next read

    def survey(self, now: datetime, *, after_id: int | None = None, show: int = 10) -> Survey:
        """The oldest due events and failures by handler, from ``after_id`` on (default: past
        the published events the last survey found below every other), reading at most
        ``SCAN_BUDGET`` events."""
        if after_id is None:
            with self._lock:
                after_id = self._survey_from
        found = Survey(first_id=after_id, last_id=after_id)
        open_from: int | None = None  # the first id read that is not published
        due: list[Event] = []  # the oldest ``show`` due events, without their payloads
        failing: dict[str, tuple[set[str], int, int]] = {}
        by_topic: dict[str, int] = {}
        for event in self._events(after_id):
            found.scanned += 1
            found.last_id = event.id
            if open_from is None and event.state is not State.PUBLISHED:
                open_from = event.id - 1
            by_topic[event.topic] = by_topic.get(event.topic, 0) + 1
            if _state_name(event, now) == "due" and event.available_at is not None:
                due.append(_without_payload(event))
                if len(due) > show:
                    due.sort(key=_due_order)
                    due.pop()
            if event.last_error and event.state is not State.PUBLISHED:
                handler = event.last_error.split(": ", 1)[0]
                topics, dead, retrying = failing.get(handler, (set(), 0, 0))
                topics.add(event.topic)
                is_dead = event.state is State.DEAD
                failing[handler] = (topics, dead + is_dead, retrying + (not is_dead))
            if found.scanned >= SCAN_BUDGET:
                found.complete = False
                break
        found.due = sorted(due, key=_due_order)
        with self._lock:
            self._survey_from = max(
                self._survey_from, found.last_id if open_from is None else open_from
            )
        found.failures = sorted(
            (
                HandlerFailures(handler, dead, retrying, sum(by_topic[t] for t in topics))
                for handler, (topics, dead, retrying) in failing.items()
            ),
            key=lambda r: (-r.rate, r.handler),
        )
        return found

    def page(
        self, wanted: EventFilter, now: datetime, after_id: int = 0
    ) -> tuple[list[Event], int, bool]:
        """One page of events matching ``wanted``, from ``after_id`` on: the rows, the id to
        go on after, and whether there may be more."""
        rows: list[Event] = []
        last = after_id
        events = self._events(after_id, topic=wanted.topic or None)
        for scanned, event in enumerate(events, start=1):
            last = event.id
            if wanted.matches(event, now):
                rows.append(_without_payload(event))
                if len(rows) >= PAGE_ROWS:
                    return rows, last, True
            if scanned >= SCAN_BUDGET:
                return rows, last, True
        return rows, last, False

    def dead_page(
        self, wanted: EventFilter, after: tuple[datetime, int] | None
    ) -> tuple[list[DeadLetter], tuple[datetime, int] | None]:
        """One page of dead letters matching ``wanted`` (oldest failure first), and the
        cursor after it (None: the last page)."""
        rows: list[DeadLetter] = []
        cursor = after
        for scanned, (letter, matched) in enumerate(self._dead(wanted, after), start=1):
            cursor = (letter.failed_at, letter.event.id)
            if matched:
                rows.append(_light(letter))
                if len(rows) >= PAGE_ROWS:
                    return rows, cursor
            if scanned >= SCAN_BUDGET:
                return rows, cursor
        return rows, None

    def _dead(
        self, wanted: EventFilter, after: tuple[datetime, int] | None, as_of: datetime | None = None
    ) -> Iterator[tuple[DeadLetter, bool]]:
        """Dead letters in failure order, each with whether ``wanted`` matches it (those it
        does not match count against a caller's budget too)."""
        now = self.outbox.now()
        topic = wanted.topic or None
        for letter in iter_dead_letters(self.outbox, topic=topic, page_size=READ_PAGE, after=after):
            if as_of is not None and letter.failed_at > as_of:
                return
            yield letter, wanted.matches(letter.event, now)

    def matching_dead(self, wanted: EventFilter, as_of: datetime) -> tuple[list[int], bool]:
        """The ids of the dead letters ``wanted`` matches that failed at or before ``as_of``
        (at most ``BULK_LIMIT``), and whether more match."""
        ids: list[int] = []
        for letter, matched in self._dead(wanted, None, as_of=as_of):
            if not matched:
                continue
            if len(ids) >= BULK_LIMIT:
                return ids, True
            ids.append(letter.event.id)
        return ids, False

    def held_keys(self, limit: int = 20) -> list[DeadEventKey]:
        """The keys with a dead event, each with it (the first ``limit``)."""
        found = dead_keys(self.outbox, limit=limit, page_size=READ_PAGE)
        return [DeadEventKey(k.key, _light(k.dead)) for k in found]

    def event(self, event_id: int) -> tuple[Event | None, DeadLetter | None]:
        """One event, and its dead letter (with delivery records) when it is dead."""
        return self.outbox.store.get(event_id), self.outbox.dead_letter(event_id)

    def errors(self, event_id: int) -> list[AttemptError] | None:
        """The error of each failed attempt of one event, oldest first; None when the store
        keeps only the last one (``capabilities.error_history``)."""
        if not self.outbox.store.capabilities.error_history:
            return None
        return self.outbox.attempt_errors(event_id)

    # -- acting -------------------------------------------------------------------------------

    def requeue(self, ids: list[int]) -> int:
        """Requeue dead letters; how many were requeued (those not dead are left alone)."""
        return sum(self.outbox.requeue(ids[i : i + 500]) for i in range(0, len(ids), 500))

    def purge(self, ids: list[int]) -> int:
        """Delete dead letters with their records; how many were deleted."""
        return sum(self.outbox.purge(dead_ids=ids[i : i + 500]) for i in range(0, len(ids), 500))

    def actions(self) -> dict[str, Callable[[list[int]], int]]:
        """The actions by name, as the forms post them."""
        return {"requeue": self.requeue, "purge": self.purge}


def _due_order(event: Event) -> tuple[datetime, int]:
    assert event.available_at is not None
    return event.available_at, event.id


def _without_payload(event: Event) -> Event:
    """A list row keeps no payload (a page holds what it shows, not 1 MiB per row)."""
    return _replace_payload(event)


def _light(letter: DeadLetter) -> DeadLetter:
    return DeadLetter(
        event=_replace_payload(letter.event),
        failed_at=letter.failed_at,
        last_error=letter.last_error,
        records=letter.records,
    )


def _replace_payload(event: Event) -> Event:
    return replace(event, payload=None)
