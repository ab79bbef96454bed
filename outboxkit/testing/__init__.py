"""The test kit: drain an outbox synchronously under a virtual clock, and assert on what happened.

The pytest plugin (``outboxkit.pytest_plugin``) hands these out as fixtures; they work without
pytest too::

    clock = FrozenClock()
    outbox = Outbox(MemoryStore(), bus, clock=clock)
    drain = Drain(outbox, clock)
    ...
    report = drain()                     # claim -> deliver -> settle until nothing is due
    report.assert_delivered("order.placed", handler="send-receipt")

``Drain`` runs the production path (``Poller.run_once``) in rounds. When nothing is due but
retries are waiting, it moves the clock to the earliest one, so a backoff schedule of hours
finishes at once while every recorded time keeps the real schedule.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from ..bus import EventBus
from ..clock import FrozenClock, as_timedelta, parse_instant
from ..core.model import Event, Outcome, State
from ..errors import ConfigurationError, DrainError
from ..outbox import Outbox
from ..poller import Delivery, PollReport
from ..store import Store

__all__ = [
    "Capture",
    "Drain",
    "DrainReport",
    "FreezegunClock",
    "HandlerErrors",
    "open_test_store",
]

PAGE = 1000


# -- reports ------------------------------------------------------------------------------------


@dataclass
class DrainReport:
    """Everything one drain did.

    Attributes:
        deliveries: every handler run, in order (event id, topic, handler, attempt, outcome,
            error, virtual time).
        published / retried / dead_lettered: event ids, in the order it happened (an event
            retried twice appears twice in ``retried``).
        rounds: how many rounds claimed something.
        pending: events still pending at the end (scheduled past ``until``).
        advanced: how far the drain moved the clock.
        topics_per_round: the topics claimed in each round (the cascade, round by round).
    """

    deliveries: list[Delivery] = field(default_factory=list)
    published: list[int] = field(default_factory=list)
    retried: list[int] = field(default_factory=list)
    dead_lettered: list[int] = field(default_factory=list)
    lease_lost: list[int] = field(default_factory=list)
    rounds: int = 0
    pending: list[Event] = field(default_factory=list)
    advanced: timedelta = timedelta(0)
    topics_per_round: list[list[str]] = field(default_factory=list)
    _topics: dict[int, str] = field(default_factory=dict, repr=False)

    @property
    def rejected(self) -> list[Delivery]:
        return [d for d in self.deliveries if d.outcome is Outcome.REJECTED]

    @property
    def failed(self) -> list[Delivery]:
        return [d for d in self.deliveries if d.outcome is Outcome.FAILED]

    def deliveries_to(self, topic: str | None = None, handler: str | None = None) -> list[Delivery]:
        """The deliveries matching ``topic`` and/or ``handler``."""
        return [
            d
            for d in self.deliveries
            if (topic is None or d.topic == topic) and (handler is None or d.handler == handler)
        ]

    def _add(self, report: PollReport, topics: Mapping[int, str]) -> None:
        self._topics.update(topics)
        self.deliveries.extend(report.deliveries)
        self.published.extend(report.published)
        self.retried.extend(report.retried)
        self.dead_lettered.extend(report.dead_lettered)
        self.lease_lost.extend(report.lease_lost)

    # -- assertions -----------------------------------------------------------------------------

    def assert_delivered(
        self, topic: str, *, handler: str | None = None, count: int | None = None
    ) -> None:
        """Some event of ``topic`` was delivered with success (to ``handler``, ``count`` times).

        Raises:
            AssertionError: with the report's summary.
        """
        hits = [d for d in self.deliveries_to(topic, handler) if d.outcome is Outcome.SUCCEEDED]
        self._check(hits, count, f"delivered {topic!r}" + (f" to {handler!r}" if handler else ""))

    def assert_rejected(
        self, topic: str, *, handler: str | None = None, count: int | None = None
    ) -> None:
        """Some event of ``topic`` was rejected (by ``handler``), ``count`` times if given."""
        hits = [d for d in self.deliveries_to(topic, handler) if d.outcome is Outcome.REJECTED]
        self._check(hits, count, f"rejected {topic!r}" + (f" by {handler!r}" if handler else ""))

    def assert_dead_lettered(self, topic: str, *, count: int | None = None) -> None:
        """Some event of ``topic`` was dead-lettered, ``count`` times if given."""
        hits = [i for i in self.dead_lettered if self._topics.get(i) == topic]
        self._check(hits, count, f"dead-lettered {topic!r}")

    def _check(self, hits: Sequence[object], count: int | None, what: str) -> None:
        if (count is None and not hits) or (count is not None and len(hits) != count):
            expected = "at least once" if count is None else f"{count} time(s)"
            raise AssertionError(f"expected {what} {expected}, found {len(hits)}\n{self.summary()}")

    def summary(self) -> str:
        """A few lines a human reads in a failing test."""
        lines = [
            f"DrainReport: {self.rounds} round(s), {len(self.deliveries)} deliveries, "
            f"{len(self.published)} published, {len(self.retried)} retried, "
            f"{len(self.dead_lettered)} dead-lettered, {len(self.pending)} still pending, "
            f"clock advanced {self.advanced.total_seconds():g}s"
        ]
        for d in self.deliveries[:50]:
            error = f" ({d.error})" if d.error else ""
            lines.append(
                f"  event {d.event_id} {d.topic!r} -> {d.handler}: {d.outcome.value} "
                f"on attempt {d.attempt} at {d.at.isoformat()}{error}"
            )
        if len(self.deliveries) > 50:
            lines.append(f"  ... {len(self.deliveries) - 50} more")
        for e in self.pending[:20]:
            lines.append(f"  pending: event {e.id} {e.topic!r} available at {e.available_at}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


class HandlerErrors(DrainError, ExceptionGroup):  # type: ignore[misc,unused-ignore]
    """Unexpected handler exceptions from one drain, raised together once it finished.

    ``report`` is the full ``DrainReport``; the group's exceptions are the handlers' own.
    """

    report: DrainReport

    def __new__(
        cls, message: str, exceptions: Sequence[Exception], report: DrainReport
    ) -> HandlerErrors:
        self = super().__new__(cls, message, exceptions)
        self.report = report
        return self

    def __init__(self, message: str, exceptions: Sequence[Exception], report: DrainReport) -> None:
        super().__init__(message, exceptions)

    def derive(self, excs: Sequence[Exception]) -> HandlerErrors:  # type: ignore[override]
        return HandlerErrors(self.message, excs, self.report)


# -- capture ------------------------------------------------------------------------------------


class Capture:
    """The events enqueued since the block began (``with drain.capture() as cap``)."""

    def __init__(self, drain: Drain) -> None:
        self._drain = drain
        self._after = drain._last_id()
        self._until: int | None = None

    def _close(self) -> None:
        self._until = self._drain._last_id()

    @property
    def events(self) -> list[Event]:
        events = self._drain._events_after(self._after)
        return [e for e in events if self._until is None or e.id <= self._until]

    def enqueued(self, topic: str | None = None) -> list[Event]:
        return [e for e in self.events if topic is None or e.topic == topic]

    def assert_enqueued(
        self, topic: str, payload: Mapping[str, Any] | None = None, count: int | None = None
    ) -> list[Event]:
        return _assert_enqueued(self._drain, self.enqueued(topic), topic, payload, count)

    def refute_enqueued(self, topic: str, payload: Mapping[str, Any] | None = None) -> None:
        _refute_enqueued(self.enqueued(topic), topic, payload)


def _matches(payload: Any, partial: Mapping[str, Any] | None) -> bool:
    if partial is None:
        return True
    if not isinstance(payload, Mapping):
        return False
    return all(k in payload and payload[k] == v for k, v in partial.items())


def _assert_enqueued(
    drain: Drain,
    candidates: list[Event],
    topic: str,
    payload: Mapping[str, Any] | None,
    count: int | None,
) -> list[Event]:
    hits = [e for e in candidates if _matches(e.payload, payload)]
    drain._asserted.update(e.id for e in hits)
    if (count is None and not hits) or (count is not None and len(hits) != count):
        expected = "at least one" if count is None else str(count)
        seen = "\n".join(f"  event {e.id} {e.topic!r}: {e.payload!r}" for e in candidates[:20])
        where = f" with payload ⊇ {dict(payload)!r}" if payload is not None else ""
        raise AssertionError(
            f"expected {expected} {topic!r} event(s){where}, found {len(hits)}; "
            f"{topic!r} events enqueued:\n{seen or '  (none)'}"
        )
    return hits


def _refute_enqueued(
    candidates: list[Event], topic: str, payload: Mapping[str, Any] | None
) -> None:
    hits = [e for e in candidates if _matches(e.payload, payload)]
    if hits:
        shown = "\n".join(f"  event {e.id}: {e.payload!r}" for e in hits[:20])
        raise AssertionError(f"expected no {topic!r} event, found {len(hits)}:\n{shown}")


# -- the drain ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Expected:
    handlers: frozenset[str]
    types: tuple[type[BaseException], ...]

    def covers(self, delivery: Delivery) -> bool:
        if not self.handlers and not self.types:
            return True
        if delivery.handler in self.handlers:
            return True
        return bool(self.types) and isinstance(delivery.exception, self.types)


class Drain:
    """Deliver everything due, synchronously, on the production path, under a ``FrozenClock``.

    Args:
        outbox: the outbox to drain (its store, bus and options).
        clock: the virtual clock; the drain advances it to pending retries.
    """

    def __init__(self, outbox: Outbox, clock: FrozenClock) -> None:
        self.outbox = outbox
        self.clock = clock
        self._expected: list[_Expected] = []
        self._asserted: set[int] = set()
        self._drained: set[int] = set()
        self._baseline = self._last_id()

    # -- draining -------------------------------------------------------------------------------

    def __call__(
        self,
        *,
        until: datetime | timedelta | None = None,
        max_rounds: int = 50,
        raise_errors: bool = True,
    ) -> DrainReport:
        """Run rounds until nothing is due; deliver follow-ups in later rounds.

        Args:
            until: also deliver events scheduled up to this instant (or this far ahead);
                without it, events the app scheduled for later stay pending.
            max_rounds: the most rounds that may claim something (a cascade guard).
            raise_errors: raise unexpected handler exceptions together at the end.

        Returns:
            The ``DrainReport``.

        Raises:
            DrainError: more than ``max_rounds`` rounds (the message names the topic chain).
            HandlerErrors: handler exceptions not covered by ``expect_failures`` (an
                ``ExceptionGroup`` carrying ``.report``), after every outcome was recorded.
        """
        if not isinstance(max_rounds, int) or isinstance(max_rounds, bool) or max_rounds < 1:
            raise ConfigurationError(f"max_rounds must be an integer >= 1, got {max_rounds!r}")
        start = self.clock.now()
        horizon = self._horizon(start, until)
        report = DrainReport()
        poller = self.outbox.poller()
        while True:
            round_report = poller.run_once()
            if round_report.claimed:
                topics = self._topics_of(round_report)
                report.rounds += 1
                report.topics_per_round.append([topics[i] for i in round_report.claimed])
                report._add(round_report, topics)
                self._drained.update(round_report.claimed)
                if report.rounds >= max_rounds and self._next_due(horizon) is not None:
                    raise DrainError(self._cascade_message(report, max_rounds))
                continue
            next_at = self._next_due(horizon)
            if next_at is None:
                break
            if next_at > self.clock.now():
                self.clock.set(next_at)
        report.advanced = self.clock.now() - start
        report.pending = [e for e in self._events_after(0) if e.state is State.PENDING]
        if raise_errors:
            self._raise_unexpected(report)
        return report

    def _horizon(self, start: datetime, until: datetime | timedelta | None) -> datetime | None:
        if until is None:
            return None
        if isinstance(until, datetime):
            if until.tzinfo is None:
                raise ConfigurationError(f"until must be an aware datetime, got {until!r}")
            return until
        try:
            return start + as_timedelta(until, what="until")
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from None

    def _next_due(self, horizon: datetime | None) -> datetime | None:
        """The earliest instant something becomes claimable: a retry, an expired lease, or an
        app-scheduled event within ``horizon``. None when nothing is left to do."""
        now = self.clock.now()
        best: datetime | None = None
        for event in self._events_after(0):
            if event.state is not State.PENDING or event.available_at is None:
                continue
            at = max(event.available_at, event.locked_until or event.available_at)
            scheduled_later = event.attempts == 0 and event.available_at > now
            if scheduled_later and (horizon is None or event.available_at > horizon):
                continue
            if best is None or at < best:
                best = at
        return best

    def _topics_of(self, report: PollReport) -> dict[int, str]:
        topics = {d.event_id: d.topic for d in report.deliveries}
        missing = [i for i in report.claimed if i not in topics]
        for event_id in missing:
            event = self.outbox.store.get(event_id)
            topics[event_id] = event.topic if event is not None else "?"
        return topics

    def _cascade_message(self, report: DrainReport, max_rounds: int) -> str:
        chain = " -> ".join("+".join(dict.fromkeys(t)) for t in report.topics_per_round[-10:])
        return (
            f"drain still had work after max_rounds={max_rounds} rounds: a handler cascade "
            f"that never ends? topics per round (last 10): {chain}"
        )

    def _raise_unexpected(self, report: DrainReport) -> None:
        unexpected = [
            d
            for d in report.failed
            if isinstance(d.exception, Exception) and not any(x.covers(d) for x in self._expected)
        ]
        if unexpected:
            excs: list[Exception] = [d.exception for d in unexpected]  # type: ignore[misc]
            raise HandlerErrors(
                f"{len(unexpected)} unexpected handler failure(s) during the drain "
                f"(use raise_errors=False or expect_failures() for retry tests)\n"
                + report.summary(),
                excs,
                report,
            )

    @contextlib.contextmanager
    def expect_failures(self, *what: str | type[BaseException]) -> Iterator[None]:
        """Within the block, handler failures by these handler names or exception types (all
        failures when none are given) are expected: recorded and retried, not raised."""
        handlers = frozenset(w for w in what if isinstance(w, str))
        types = tuple(w for w in what if isinstance(w, type) and issubclass(w, BaseException))
        if len(handlers) + len(types) != len(what):
            raise ConfigurationError(
                f"expect_failures takes handler names or exception types, got {what!r}"
            )
        expected = _Expected(handlers, types)
        self._expected.append(expected)
        try:
            yield
        finally:
            self._expected.remove(expected)

    # -- enqueue assertions ---------------------------------------------------------------------

    def enqueued(self, topic: str | None = None) -> list[Event]:
        """Events enqueued since the drain was made (any state), optionally of one topic."""
        return [e for e in self._events_after(self._baseline) if topic is None or e.topic == topic]

    def assert_enqueued(
        self, topic: str, payload: Mapping[str, Any] | None = None, count: int | None = None
    ) -> list[Event]:
        """Some (or exactly ``count``) ``topic`` events whose payload contains ``payload``'s items.

        Returns:
            The matching events.

        Raises:
            AssertionError: listing the events of that topic that were enqueued.
        """
        return _assert_enqueued(self, self.enqueued(topic), topic, payload, count)

    def refute_enqueued(self, topic: str, payload: Mapping[str, Any] | None = None) -> None:
        """No ``topic`` event (whose payload contains ``payload``'s items) was enqueued."""
        _refute_enqueued(self.enqueued(topic), topic, payload)

    @contextlib.contextmanager
    def capture(self) -> Iterator[Capture]:
        """``with drain.capture() as cap:`` - ``cap`` sees only what the block enqueued."""
        cap = Capture(self)
        try:
            yield cap
        finally:
            cap._close()

    # -- one handler --------------------------------------------------------------------------

    def deliver_one(
        self,
        handler: str,
        payload: Any,
        *,
        headers: Mapping[str, str] | None = None,
        raise_errors: bool = True,
    ) -> DrainReport:
        """Run one handler alone on a new event, through the real delivery path.

        The event is enqueued on the handler's topic and drained by an outbox whose bus holds
        only that handler; events already waiting are left untouched (their leases are not
        taken: the event is delivered before them by being claimed alone).

        Raises:
            ConfigurationError: no handler (or several) of that name.
            HandlerErrors: the handler failed and ``raise_errors`` is true.
        """
        spec = self.outbox.bus.find(handler)
        solo_bus = EventBus()
        solo_bus.subscribe(spec.topic, spec.fn, name=spec.name, transactional=spec.transactional)
        solo = self.outbox.rebind()
        solo.bus = solo_bus
        with solo.store.transaction() as conn:
            event_id = solo.enqueue(conn, spec.topic, payload, headers=headers)
        # Claim what is due, keep our event, and hand the others back untouched (their
        # attempts refunded), so only the new event is delivered.
        claimed_at = self.clock.now()
        claims = solo.store.claim(
            batch_size=100_000, lease=solo.options.lease, now=solo.store_now()
        )
        ours = [c for c in claims if c.event.id == event_id]
        solo.store.release([c for c in claims if c.event.id != event_id], now=solo.store_now())
        report = DrainReport()
        round_report = solo.poller().process(ours, claimed_at=claimed_at)
        report._add(round_report, {event_id: spec.topic})
        report.rounds = 1
        self._drained.add(event_id)
        if raise_errors:
            self._raise_unexpected(report)
        return report

    # -- bookkeeping --------------------------------------------------------------------------

    def _events_after(self, after_id: int) -> list[Event]:
        events: list[Event] = []
        while page := self.outbox.store.events(after_id=after_id, limit=PAGE):
            events.extend(page)
            after_id = page[-1].id
            if len(page) < PAGE:
                break
        return events

    def _last_id(self) -> int:
        events = self._events_after(0)
        return events[-1].id if events else 0

    def unaccounted(self) -> list[Event]:
        """Events enqueued since the drain was made that were neither drained nor asserted."""
        return [
            e
            for e in self._events_after(self._baseline)
            if e.id not in self._drained and e.id not in self._asserted
        ]


# -- clocks and stores for tests ----------------------------------------------------------------


class FreezegunClock(FrozenClock):
    """A ``FrozenClock`` that is freezegun's frozen time: app code calling ``datetime.now()`` or
    ``time.time()`` sees the same instant, and moving either (``advance``/``set`` here, or
    ``tick``/``move_to`` on freezegun's factory) moves both."""

    def __init__(self, frozen: Any) -> None:
        super().__init__(
            frozen.time_to_freeze.replace(tzinfo=UTC)
            if frozen.time_to_freeze.tzinfo is None
            else frozen.time_to_freeze
        )
        self._frozen = frozen

    @property
    def freezer(self) -> Any:
        """freezegun's time factory (``tick``, ``move_to``) behind this clock."""
        return self._frozen

    def now(self) -> datetime:
        fake = self._frozen()  # freezegun's current (naive UTC) instant
        return datetime(
            fake.year,
            fake.month,
            fake.day,
            fake.hour,
            fake.minute,
            fake.second,
            fake.microsecond,
            tzinfo=UTC,
        )

    def advance(self, by: float | timedelta) -> datetime:
        self._frozen.tick(as_timedelta(by, what="advance"))
        now = self.now()
        self._notify(now)
        return now

    def set(self, instant: datetime | str) -> datetime:
        value = parse_instant(instant)
        self._frozen.move_to(value)
        self._notify(value)
        return value


@contextlib.contextmanager
def open_test_store(url: str | None, tmp_path: Path, name: str = "test") -> Iterator[Store]:
    """A fresh, migrated store for one test; removed afterwards.

    ``None`` gives a SQLite file under ``tmp_path``; ``memory://`` an in-memory store; a
    ``postgresql://`` URL a schema of its own (named after ``name`` and the xdist worker),
    dropped at the end.
    """
    from ..plugins import open_store

    if url is None:
        path = tmp_path / "outbox.db"
        shutil.copyfile(_sqlite_template(), path)  # a migrated empty file: no DDL per test
        url = f"sqlite:///{path}"
    scheme = url.split("://", 1)[0].lower()
    options: dict[str, Any] = {}
    if scheme in ("postgresql", "postgres"):
        options["schema"] = _schema_name(name)
    store: Store = open_store(url, **options)
    try:
        store.migrate()
        yield store
    finally:
        drop = getattr(store, "drop_schema", None)
        try:
            if options.get("schema") and callable(drop):
                drop()
        finally:
            store.close()


@functools.cache
def _sqlite_template() -> Path:
    """An empty, migrated SQLite outbox file, made once per process and copied for each test."""
    from ..plugins import open_store

    folder = Path(tempfile.mkdtemp(prefix="outboxkit-template-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = folder / "template.db"
    store: Store = open_store(f"sqlite:///{path}")
    try:
        store.migrate()
    finally:
        store.close()
    return path


def _schema_name(name: str) -> str:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    digest = hashlib.sha1(f"{name}\0{os.getpid()}\0{uuid.uuid4()}".encode()).hexdigest()[:12]
    return f"outboxkit_test_{worker}_{digest}"[:63]
