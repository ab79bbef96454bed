"""``Drain``: deliver everything due, on the production path, under a virtual clock; and the
enqueue assertions on what was enqueued since the drain was made.

One drain, two pollers: an app whose bus has ``async def`` handlers is drained by the asyncio
poller (``Outbox.async_poller``), any other by the blocking one (``Outbox.poller``). Both run
their own ``run_until_idle`` with the same two callbacks (``_Run``): the virtual clock's rules
and the report are written once, here, for both.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from .. import calls
from ..bus import EventBus, HandlerSpec
from ..clock import FrozenClock, as_timedelta
from ..core.machine import blocks_key
from ..core.model import Claim, Delivery, Event, PollReport, State, state_of
from ..errors import ConfigurationError, DrainError
from ..outbox import Outbox
from ..waiter import LoopWaiter
from .capture import Capture, assert_enqueued, refute_enqueued
from .report import DrainReport, HandlerErrors

if TYPE_CHECKING:
    from ..aio import AsyncPoller

__all__ = ["PAGE", "Drain"]

PAGE = 1000
"""How many events the drain reads from the store per call."""

T = TypeVar("T")


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


@dataclass
class _Run:
    """One drain in progress: what both pollers' ``run_until_idle`` are given (``on_idle`` moves
    the virtual clock, ``on_round`` folds a round into the report) and what they fill in; the
    drain's steps it takes are given to it."""

    start: datetime
    horizon: datetime | None
    max_rounds: int
    advance: Callable[[datetime | None], bool]
    record: Callable[[DrainReport, PollReport], None]
    next_due: Callable[[datetime | None], datetime | None]
    cascade: Callable[[DrainReport, int], str]
    report: DrainReport = field(default_factory=DrainReport)

    def on_idle(self) -> bool:
        return self.advance(self.horizon)

    def on_round(self, round_report: PollReport) -> None:
        self.record(self.report, round_report)
        # The cascade guard: a drain whose rounds keep making work ends, naming the chain.
        if self.report.rounds >= self.max_rounds and self.next_due(self.horizon) is not None:
            raise DrainError(self.cascade(self.report, self.max_rounds))


class Drain:
    """Deliver everything due, on the production path, under a ``FrozenClock``: ``drain()``
    from a test, or ``await drain.async_()`` from an ``async def`` test.

    The poller is chosen by the bus: one with ``async def`` handlers is drained by the asyncio
    poller (``drain()`` then runs it on an event loop of its own), any other by the blocking
    poller. ``async_()`` always drives the asyncio poller, on the running loop.

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

        A bus with ``async def`` handlers is drained by the asyncio poller, on an event loop of
        the drain's own (a fresh one, closed before it returns); any other bus by the blocking
        poller. In an ``async def`` test, await :meth:`async_` instead.

        Args:
            until: also deliver events scheduled up to this instant (or this far ahead);
                without it, events due after the last retry (or lease) stay pending.
            max_rounds: the most rounds that may claim something (a cascade guard).
            raise_errors: raise unexpected handler exceptions together at the end.

        Returns:
            The ``DrainReport``.

        Raises:
            DrainError: more than ``max_rounds`` rounds (the message names the topic chain);
                or async handlers to run while an event loop is running in this thread (the
                message names ``await outbox_drain.async_()``).
            HandlerErrors: handler exceptions not covered by ``expect_failures`` (an
                ``ExceptionGroup`` carrying ``.report``), after every outcome was recorded.
            ConfigurationError: async handlers on a store without an asyncio side.
        """
        run = self._begin(until, max_rounds)
        coroutines = calls.async_handlers(self.outbox.bus.specs())
        if coroutines:
            _refuse_running_loop(
                f"outbox_drain() drains async def handlers ({_names(coroutines)}) on an event "
                "loop of its own, and one is running here: in an async def test, use "
                "`report = await outbox_drain.async_()`"
            )
            poller = self._async_poller(coroutines)
            _on_a_loop_of_its_own(
                _closing(poller, poller.run_until_idle(on_idle=run.on_idle, on_round=run.on_round))
            )
        else:
            # The poller's own drain loop, as ``outboxkit run --until-idle`` runs it; the drain
            # only adds the virtual clock (on_idle) and the report (on_round).
            # No prefetch (an app-wide default): a drain's batches are the same on every run.
            self.outbox.poller(prefetch=False).run_until_idle(
                on_idle=run.on_idle, on_round=run.on_round
            )
        return self._end(run, raise_errors)

    async def async_(
        self,
        *,
        until: datetime | timedelta | None = None,
        max_rounds: int = 50,
        raise_errors: bool = True,
    ) -> DrainReport:
        """``drain()`` from an ``async def`` test: the asyncio poller's ``run_until_idle`` on the
        running event loop, with the same virtual clock, rounds, report and errors.

        It drives the asyncio poller whatever the bus holds, as ``outboxkit run --asyncio``
        would: a blocking transactional handler is refused by it (a blocking non-transactional
        one runs in a worker thread).

        Args:
            until: as for ``drain()``.
            max_rounds: as for ``drain()``.
            raise_errors: as for ``drain()``.

        Returns:
            The ``DrainReport``.

        Raises:
            DrainError: more than ``max_rounds`` rounds (the message names the topic chain).
            HandlerErrors: as for ``drain()``.
            ConfigurationError: a store without an asyncio side, or a handler the asyncio
                poller refuses (a blocking transactional one).
        """
        run = self._begin(until, max_rounds)
        poller = self._async_poller(calls.async_handlers(self.outbox.bus.specs()))
        await poller.run_until_idle(on_idle=run.on_idle, on_round=run.on_round)
        return self._end(run, raise_errors)

    def _begin(self, until: datetime | timedelta | None, max_rounds: int) -> _Run:
        if not isinstance(max_rounds, int) or isinstance(max_rounds, bool) or max_rounds < 1:
            raise ConfigurationError(f"max_rounds must be an integer >= 1, got {max_rounds!r}")
        start = self.clock.now()
        return _Run(
            start,
            self._horizon(start, until),
            max_rounds,
            self._advance_to_next,
            self._record,
            self._next_due,
            self._cascade_message,
        )

    def _end(self, run: _Run, raise_errors: bool) -> DrainReport:
        report = run.report
        report.advanced = self.clock.now() - run.start
        report.pending = [e for e in self._events_after(0) if e.state is State.PENDING]
        if raise_errors:
            self._raise_unexpected(report)
        return report

    def _async_poller(
        self, coroutines: Sequence[HandlerSpec], outbox: Outbox | None = None
    ) -> AsyncPoller:
        """The asyncio poller a drain runs, with a waiter of its own: a drain never waits, so
        it needs none of the store's (a ``LISTEN`` connection only ``run_forever`` closes)."""
        outbox = outbox or self.outbox
        store = outbox.store
        if not store.capabilities.asyncio:
            why = (
                f"async def handlers ({_names(coroutines)}) run on the asyncio poller"
                if coroutines
                else "async_() drains with the asyncio poller"
            )
            raise ConfigurationError(
                f"{why}, which needs a store with an asyncio side; {store!r} has none "
                "(capabilities.asyncio is false): test on one that has, such as the memory "
                "store (ini outboxkit_store = memory://, or --outbox-store=memory://)"
            )
        return outbox.async_poller(waiter=LoopWaiter(), prefetch=False)

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
        report.add_round(round_report, topics)
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
        Events scheduled after both stay pending. An event of a key counts only while no
        earlier event of its key holds the key up (R15): it falls due when that one settles.
        """
        now = self.clock.now()
        waits: list[datetime] = []  # retries and leases: a poller waits them out
        first: list[datetime] = []  # first attempts: due now, or scheduled by the app
        held: set[str] = set()  # keys an earlier event holds up
        for event in self._events_after(0):
            if event.available_at is None:
                continue
            state = state_of(
                published_at=event.published_at,
                failed_at=event.failed_at,
                locked_until=event.locked_until,
                now=now,
            )
            if event.key is not None:
                if event.key in held:
                    continue
                if blocks_key(state, self.outbox.dead_key):
                    held.add(event.key)
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
        cap = Capture(self._last_id, self._events_after, self._asserted)
        try:
            yield cap
        finally:
            cap.close()

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
        taken: the event is delivered before them by being claimed alone). An ``async def``
        handler is run by the asyncio poller on an event loop of the drain's own; in an
        ``async def`` test, await :meth:`deliver_one_async` instead.

        Args:
            handler: the handler's name on the outbox's bus.
            payload: the new event's payload.
            headers: the new event's headers.
            raise_errors: raise the handler's exception (as ``HandlerErrors``) unless expected.

        Returns:
            A one-round ``DrainReport``.

        Raises:
            ConfigurationError: no handler (or several) of that name; an async handler on a
                store without an asyncio side.
            DrainError: an async handler while an event loop is running in this thread.
            HandlerErrors: the handler failed and ``raise_errors`` is true.
        """
        spec = self.outbox.bus.find(handler)
        if calls.is_coroutine_function(spec.fn):
            _refuse_running_loop(
                f"outbox_drain.deliver_one() runs the async def handler {spec.name!r} on an "
                "event loop of its own, and one is running here: in an async def test, use "
                "`report = await outbox_drain.deliver_one_async(...)`"
            )
        solo = self._solo(spec)
        if calls.is_coroutine_function(spec.fn):
            poller = self._async_poller([spec], solo)  # refusals before anything is written
            event_id, ours, claimed_at = self._claim_alone(solo, spec, payload, headers)
            round_report = _on_a_loop_of_its_own(
                _closing(poller, poller.process(ours, claimed_at=claimed_at))
            )
        else:
            event_id, ours, claimed_at = self._claim_alone(solo, spec, payload, headers)
            round_report = solo.poller().process(ours, claimed_at=claimed_at)
        return self._one(round_report, event_id, spec, raise_errors)

    async def deliver_one_async(
        self,
        handler: str,
        payload: Any,
        *,
        headers: Mapping[str, str] | None = None,
        raise_errors: bool = True,
    ) -> DrainReport:
        """:meth:`deliver_one` from an ``async def`` test: the handler is run by the asyncio
        poller on the running event loop.

        Args:
            handler: as for :meth:`deliver_one`.
            payload: as for :meth:`deliver_one`.
            headers: as for :meth:`deliver_one`.
            raise_errors: as for :meth:`deliver_one`.

        Returns:
            A one-round ``DrainReport``.

        Raises:
            ConfigurationError: no handler (or several) of that name; a store without an
                asyncio side; a blocking transactional handler (the asyncio poller refuses it).
            HandlerErrors: the handler failed and ``raise_errors`` is true.
        """
        spec = self.outbox.bus.find(handler)
        solo = self._solo(spec)
        coroutine = [spec] if calls.is_coroutine_function(spec.fn) else []
        poller = self._async_poller(coroutine, solo)  # refusals before anything is written
        event_id, ours, claimed_at = self._claim_alone(solo, spec, payload, headers)
        round_report = await poller.process(ours, claimed_at=claimed_at)
        return self._one(round_report, event_id, spec, raise_errors)

    def _solo(self, spec: HandlerSpec) -> Outbox:
        """A copy of the outbox whose bus holds only ``spec``."""
        solo_bus = EventBus()
        solo_bus.subscribe(spec.topic, spec.fn, name=spec.name, transactional=spec.transactional)
        solo = self.outbox.rebind()
        solo.bus = solo_bus
        return solo

    def _claim_alone(
        self, solo: Outbox, spec: HandlerSpec, payload: Any, headers: Mapping[str, str] | None
    ) -> tuple[int, list[Claim], datetime]:
        """A new event on ``spec``'s topic, and the claim of that event alone (the others
        claimed with it are handed back untouched)."""
        with solo.store.transaction() as conn:
            event_id = solo.enqueue(conn, spec.topic, payload, headers=headers)
        # Claim what is due, keep our event, and hand the others back untouched (their
        # attempts refunded), so only the new event is delivered.
        claimed_at = self.clock.now()
        claims = solo.store.claim(
            batch_size=100_000,
            lease=solo.options.lease,
            now=solo.store_now(),
            dead_key=solo.dead_key,
        )
        ours = [c for c in claims if c.event.id == event_id]
        solo.store.release([c for c in claims if c.event.id != event_id], now=solo.store_now())
        return event_id, ours, claimed_at

    def _one(
        self, round_report: PollReport, event_id: int, spec: HandlerSpec, raise_errors: bool
    ) -> DrainReport:
        report = DrainReport()
        report.add_round(round_report, {event_id: spec.topic})
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


# -- event loops ----------------------------------------------------------------------------------


def _names(specs: Sequence[HandlerSpec]) -> str:
    shown = ", ".join(repr(spec.name) for spec in specs[:5])
    return shown + (f" and {len(specs) - 5} more" if len(specs) > 5 else "")


def _refuse_running_loop(message: str) -> None:
    """Raise ``DrainError(message)`` when an event loop runs in this thread: a drain cannot run
    a loop of its own inside it (checked before any coroutine is made, so none is left
    unawaited)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise DrainError(message)


def _on_a_loop_of_its_own(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` on a fresh event loop, closed before this returns. With a loop factory
    the runner sets no event loop for the thread: a loop the test set up stays its own."""
    with asyncio.Runner(loop_factory=asyncio.new_event_loop) as runner:
        return runner.run(coroutine)


async def _closing(poller: AsyncPoller, work: Coroutine[Any, Any, T]) -> T:
    """Await ``work``, then close the store's asyncio side: its connections belong to the loop
    they were opened on, which ends with this drain."""
    try:
        return await work
    finally:
        await poller.store.close()
