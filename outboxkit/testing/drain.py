"""``Drain``: deliver everything due, synchronously, on the production path, under a virtual
clock; and the enqueue assertions on what was enqueued since the drain was made."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from ..bus import EventBus
from ..clock import FrozenClock, as_timedelta
from ..core.model import Delivery, Event, PollReport, State, state_of
from ..errors import ConfigurationError, DrainError
from ..outbox import Outbox
from .capture import Capture, assert_enqueued, refute_enqueued
from .report import DrainReport, HandlerErrors

__all__ = ["PAGE", "Drain"]

PAGE = 1000
"""How many events the drain reads from the store per call."""


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
        clock: the virtual clock; the drain moves it to the next due time while it waits out
            retries and leases.
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

        Time keeps production's order: waiting out a backoff or a lease, the drain moves the
        clock to the next due time of any event, so an event the app scheduled to fall due
        before a retry is delivered at its own time, before the retry, as a poller would.

        Args:
            until: also deliver events scheduled up to this instant (or this far ahead);
                without it, events due after the last retry (or lease) stay pending.
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

        def on_round(round_report: PollReport) -> None:
            self._record(report, round_report)
            # The cascade guard: a drain whose rounds keep making work ends, naming the chain.
            if report.rounds >= max_rounds and self._next_due(horizon) is not None:
                raise DrainError(self._cascade_message(report, max_rounds))

        # The poller's own drain loop, as ``outboxkit run --until-idle`` runs it; the drain only
        # adds the virtual clock (on_idle) and the report (on_round).
        self.outbox.poller().run_until_idle(
            on_idle=lambda: self._advance_to_next(horizon), on_round=on_round
        )
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

    def _record(self, report: DrainReport, round_report: PollReport) -> None:
        """Fold one round that claimed something into ``report``."""
        topics = self._topics_of(round_report)
        report.rounds += 1
        report.topics_per_round.append([topics[i] for i in round_report.claimed])
        report._add(round_report, topics)
        self._drained.update(round_report.claimed)

    def _advance_to_next(self, horizon: datetime | None) -> bool:
        """Move the clock to the next instant something falls due; False when the drain is done.

        Also done when nothing can be brought closer by the clock: a poll at the same instant
        would claim nothing again, and the drain would never end.
        """
        next_at = self._next_due(horizon)
        if next_at is None or next_at <= self.clock.now():
            return False
        self.clock.set(next_at)
        return True

    def _next_due(self, horizon: datetime | None) -> datetime | None:
        """The next instant an event falls due, in production's order of time; None when
        nothing is left to do.

        What a poller waits out: a retry's backoff, or a lease in force. While it waits, every
        event that falls due is delivered at its own time, so an event the app scheduled is
        within reach up to the last of those waits, or up to ``horizon`` if that is later.
        Events scheduled after both stay pending.
        """
        now = self.clock.now()
        waits: list[datetime] = []  # retries and leases: a poller waits them out
        first: list[datetime] = []  # first attempts: due now, or scheduled by the app
        for event in self._events_after(0):
            if event.available_at is None:
                continue
            state = state_of(
                published_at=event.published_at,
                failed_at=event.failed_at,
                locked_until=event.locked_until,
                now=now,
            )
            if state is State.CLAIMED and event.locked_until is not None:
                # Claimable again once the lease has run out (and the event is available).
                waits.append(max(event.available_at, event.locked_until))
            elif state is State.PENDING:
                (waits if event.attempts else first).append(event.available_at)
        reach = max([now, *waits, *([horizon] if horizon is not None else [])])
        return min([*waits, *(at for at in first if at <= reach)], default=None)

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
        failures when none are given) are expected: recorded and retried, not raised.

        Args:
            *what: handler names (``str``) and exception types, in any mix.

        Raises:
            ConfigurationError: something that is neither a name nor an exception type.
        """
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
        """Events enqueued since the drain was made (any state), optionally of one topic.

        Args:
            topic: only events of this topic (all when None).

        Returns:
            The events, in enqueue order.
        """
        return [e for e in self._events_after(self._baseline) if topic is None or e.topic == topic]

    def assert_enqueued(
        self, topic: str, payload: Mapping[str, Any] | None = None, count: int | None = None
    ) -> list[Event]:
        """Some (or exactly ``count``) ``topic`` events whose payload contains ``payload``'s items.

        What matches counts as asserted: ``outboxkit_strict`` does not report it.

        Args:
            topic: the event topic.
            payload: a partial payload every match contains (any payload when None).
            count: exactly this many matches (at least one when None).

        Returns:
            The matching events.

        Raises:
            AssertionError: listing the events of that topic that were enqueued.
        """
        return assert_enqueued(self.enqueued(topic), topic, payload, count, asserted=self._asserted)

    def refute_enqueued(self, topic: str, payload: Mapping[str, Any] | None = None) -> None:
        """No ``topic`` event (whose payload contains ``payload``'s items) was enqueued.

        Args:
            topic: the event topic.
            payload: a partial payload (any payload when None).

        Raises:
            AssertionError: listing the events that match.
        """
        refute_enqueued(self.enqueued(topic), topic, payload)

    @contextlib.contextmanager
    def capture(self) -> Iterator[Capture]:
        """``with drain.capture() as cap:`` - ``cap`` sees only what the block enqueued.

        Yields:
            The ``Capture``; it keeps what the block enqueued after the block ends.
        """
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

        Args:
            handler: the handler's name on the outbox's bus.
            payload: the new event's payload.
            headers: the new event's headers.
            raise_errors: raise the handler's exception (as ``HandlerErrors``) unless expected.

        Returns:
            A one-round ``DrainReport``.

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
        """Every event with an id above ``after_id``, read page by page."""
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
        """Events enqueued since the drain was made that were neither drained nor asserted.

        Returns:
            The events, in enqueue order (what ``outboxkit_strict`` fails a test for).
        """
        return [
            e
            for e in self._events_after(self._baseline)
            if e.id not in self._drained and e.id not in self._asserted
        ]
