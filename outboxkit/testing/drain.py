"""``Drain``: deliver everything due, on the production path, under a virtual clock; and the
enqueue assertions on every event of the test store.

One drain, two pollers: an app whose bus has ``async def`` handlers is drained by the asyncio
poller (``Outbox.async_poller``), any other by the blocking one (``Outbox.poller``). Both run
their own ``run_until_idle`` with the same two callbacks (``_Run``): the virtual clock's rules
and the report are written once, here, for both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from .. import calls
from ..bus import HandlerSpec
from ..clock import FrozenClock, as_timedelta
from ..core.machine import blocks_key
from ..core.model import Claim, Delivery, Event, PollReport, State, state_of
from ..errors import ConfigurationError, DrainError
from ..outbox import Outbox
from ..waiter import LoopWaiter
from .aim import AimedStore, CrashAt, InjectedCrash, Selection, crash_points
from .capture import Capture, assert_enqueued, refute_enqueued
from .left import left_reasons
from .loops import closing, names, on_a_loop_of_its_own, refuse_running_loop
from .matching import UNSET, EventFilter, Matcher
from .relay import TestRelay
from .report import DrainReport, HandlerErrors, first_failure_line
from .solo import DeliverOne
from .statements import HandlerTracker, StatementCount, counting
from .through import events_through, stray_message

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
    advance: Callable[[datetime | None, bool, bool], bool]
    record: Callable[[DrainReport, PollReport], None]
    next_due: Callable[[datetime | None], datetime | None]
    cascade: Callable[[DrainReport, int], str]
    fail_fast: Callable[[DrainReport], None] | None = None
    advance_time: bool = True
    last_read: Callable[[], list[Event] | None] = lambda: None
    seen: list[Event] | None = None
    report: DrainReport = field(default_factory=DrainReport)

    def on_idle(self) -> bool:
        """A poll claimed nothing: move the clock to the next due time and poll again."""
        if not self.advance_time:
            return False
        return self._advance(after_claim=False)

    def after_short_round(self) -> bool:
        """A poll claimed less than a batch: poll again if something is due now (a follow-up
        its handlers enqueued) or, moving the clock, later; else the drain is done without
        the poll that would claim nothing."""
        return self._advance(after_claim=True)

    def _advance(self, *, after_claim: bool) -> bool:
        more = self.advance(self.horizon, after_claim, self.advance_time)
        self.seen = None if more else self.last_read()
        return more

    def on_round(self, round_report: PollReport) -> None:
        self.seen = None
        self.record(self.report, round_report)
        if self.fail_fast is not None:
            self.fail_fast(self.report)
        # The cascade guard: a drain whose rounds keep making work ends, naming the chain.
        if self.report.rounds >= self.max_rounds and self.next_due(self.horizon) is not None:
            raise DrainError(self.cascade(self.report, self.max_rounds))


class Drain(DeliverOne):
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

    def __init__(
        self,
        outbox: Outbox,
        clock: FrozenClock,
        *,
        strays: Callable[[], list[str]] | None = None,
        since: int = 0,
    ) -> None:
        self.outbox = outbox
        self.clock = clock
        self._expected: list[_Expected] = []
        self._asserted: set[int] = set()
        self._drained: set[int] = set()
        self._strays = strays or (lambda: [])
        self._since = since
        self._relay: tuple[TestRelay, tuple[str, ...] | None] | None = None
        self._selection = Selection()
        self._tracker: HandlerTracker | None = None
        self._counts: list[StatementCount] = []
        self._seen: list[Event] | None = None

    # -- draining -------------------------------------------------------------------------------

    def __call__(
        self,
        *,
        until: datetime | timedelta | None = None,
        max_rounds: int = 50,
        raise_errors: bool = True,
        topics: Sequence[str] | None = None,
        handlers: Sequence[str] | None = None,
        limit: int | None = None,
        advance_time: bool = True,
        fail_fast: bool = False,
        crash_at: str | CrashAt | Sequence[str | CrashAt] = (),
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
            topics: deliver only events of these topics (the others stay, said in
                ``report.left``).
            handlers: deliver only events one of these handlers takes (their other handlers
                run too: an event is published once all of its handlers ran).
            limit: claim at most this many events (each retry counts).
            advance_time: False never moves the clock: what is due now is delivered, and a
                retry stays scheduled, to be asserted on (``report.left``).
            fail_fast: stop at the first unexpected handler failure and raise it
                (``HandlerErrors`` whose first line names the handler, the event and the error).
            crash_at: crash points (``CrashAt``, or a point's name for the first delivery):
                see ``outboxkit.testing.CrashAt``.

        Returns:
            The ``DrainReport``.

        Raises:
            DrainError: more than ``max_rounds`` rounds (the message names the topic chain);
                or async handlers to run while an event loop is running in this thread (the
                message names ``await outbox_drain.async_()``); or an enqueue of this test
                went to another database than the test store's (naming it).
            HandlerErrors: handler exceptions not covered by ``expect_failures`` (an
                ``ExceptionGroup`` carrying ``.report``, its first line naming the first
                failure), after every outcome was recorded.
            ConfigurationError: async handlers on a store without an asyncio side; a bad
                option (naming it).
        """
        self._refuse_strays()
        run, outbox = self._begin(
            until, max_rounds, topics, handlers, limit, advance_time, fail_fast, crash_at
        )
        coroutines = calls.async_handlers(outbox.bus.specs())
        if coroutines:
            refuse_running_loop(
                f"outbox_drain() drains async def handlers ({names(coroutines)}) on an event "
                "loop of its own, and one is running here: in an async def test, use "
                "`report = await outbox_drain.async_()`"
            )
            poller = self._async_poller(coroutines, outbox)
            on_a_loop_of_its_own(
                closing(
                    poller,
                    poller.run_until_idle(
                        on_idle=run.on_idle,
                        on_round=run.on_round,
                        after_short_round=run.after_short_round,
                    ),
                )
            )
        else:
            self._run_blocking(run, outbox)
        return self._end(run, raise_errors)

    def _run_blocking(self, run: _Run, outbox: Outbox) -> None:
        """The poller's own drain loop, as ``outboxkit run --until-idle`` runs it; the drain
        only adds the virtual clock (on_idle) and the report (on_round). An injected crash
        ends a poller; a new one (a restarted process) goes on."""
        store = outbox.store
        while True:
            # No prefetch (an app-wide default): a drain's batches are the same on every run.
            try:
                outbox.poller(prefetch=False).run_until_idle(
                    on_idle=run.on_idle,
                    on_round=run.on_round,
                    after_short_round=run.after_short_round,
                )
            except InjectedCrash as crash:
                run.report.crashes.append(str(crash))
                continue
            if isinstance(store, AimedStore):
                run.report.crashes.extend(store.notes)
            if isinstance(store, AimedStore) and store.stale:
                stale, store.stale = store.stale, []
                for claim in stale:  # a poller that slept through its lease wakes up
                    round_report = outbox.poller(prefetch=False).process(
                        [claim], claimed_at=self.clock.now()
                    )
                    run.record(run.report, round_report)
                    run.report.crashes.append(
                        f"stale poller ran event {claim.event.id} again after its lease"
                    )
            return

    async def async_(
        self,
        *,
        until: datetime | timedelta | None = None,
        max_rounds: int = 50,
        raise_errors: bool = True,
        topics: Sequence[str] | None = None,
        handlers: Sequence[str] | None = None,
        limit: int | None = None,
        advance_time: bool = True,
        fail_fast: bool = False,
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
            topics: as for ``drain()``.
            handlers: as for ``drain()``.
            limit: as for ``drain()``.
            advance_time: as for ``drain()``.
            fail_fast: as for ``drain()``.

        Returns:
            The ``DrainReport``.

        Raises:
            DrainError: more than ``max_rounds`` rounds (the message names the topic chain).
            HandlerErrors: as for ``drain()``.
            ConfigurationError: a store without an asyncio side, or a handler the asyncio
                poller refuses (a blocking transactional one); a bad option (naming it).
        """
        self._refuse_strays()
        run, outbox = self._begin(
            until, max_rounds, topics, handlers, limit, advance_time, fail_fast, ()
        )
        poller = self._async_poller(calls.async_handlers(outbox.bus.specs()), outbox)
        await poller.run_until_idle(
            on_idle=run.on_idle, on_round=run.on_round, after_short_round=run.after_short_round
        )
        return self._end(run, raise_errors)

    def _begin(
        self,
        until: datetime | timedelta | None,
        max_rounds: int,
        topics: Sequence[str] | None,
        handlers: Sequence[str] | None,
        limit: int | None,
        advance_time: bool,
        fail_fast: bool,
        crash_at: str | CrashAt | Sequence[str | CrashAt],
    ) -> tuple[_Run, Outbox]:
        if not isinstance(max_rounds, int) or isinstance(max_rounds, bool) or max_rounds < 1:
            raise ConfigurationError(f"max_rounds must be an integer >= 1, got {max_rounds!r}")
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 1
        ):
            raise ConfigurationError(f"limit must be an integer >= 1, got {limit!r}")
        for what, given in (("topics", topics), ("handlers", handlers)):
            if isinstance(given, str):
                raise ConfigurationError(f"{what} must be a list, got the string {given!r:.80}")
        names = frozenset(handlers) if handlers is not None else None
        for name in names or ():
            self.outbox.bus.find(name)  # ConfigurationError naming an unknown handler
        self._selection = Selection(
            frozenset(topics) if topics is not None else None,
            limit,
            names,
            self.outbox.bus.names_for,
        )
        crashes = crash_points(crash_at)
        outbox = self.outbox
        if self._relay is not None:
            relay, relayed = self._relay
            outbox = relay.bound(outbox, relayed)
        if topics is not None or handlers is not None or limit is not None or crashes:
            aimed = AimedStore(outbox.store, self._selection, crashes, self._wait_out_lease)
            outbox = outbox.rebind(store=aimed)
            if crashes:
                outbox.add_observer(aimed.seen)
        start = self.clock.now()
        run = _Run(
            start,
            self._horizon(start, until),
            max_rounds,
            self._advance_to_next,
            self._record,
            self._next_due,
            self._cascade_message,
            self._fail_fast if fail_fast else None,
            advance_time,
            self._last_read,
        )
        self._seen = None
        return run, outbox

    def _last_read(self) -> list[Event] | None:
        """The events the last idle check read (None when it read none)."""
        return self._seen

    def _wait_out_lease(self, claim: Claim) -> None:
        """A ``lease_lost`` crash point: the handler ran past its lease."""
        self.clock.set(max(self.clock.now(), claim.locked_until))

    def _end(self, run: _Run, raise_errors: bool) -> DrainReport:
        report = run.report
        report.advanced = self.clock.now() - run.start
        # What the last idle check read, when no round ran since (one read less per drain).
        events = run.seen if run.seen is not None else self._events_after(0)
        report.pending = [e for e in events if e.state is State.PENDING]
        report.keys = {e.id: e.key for e in events}
        report.left = left_reasons(
            events,
            now=self.clock.now(),
            horizon=run.horizon,
            advance_time=run.advance_time,
            why_not=self._selection.why_not,
            dead_key=self.outbox.dead_key,
        )
        if raise_errors:
            self._raise_unexpected(report)
        return report

    def _fail_fast(self, report: DrainReport) -> None:
        unexpected = self._unexpected(report)
        if unexpected:
            first = unexpected[0]
            raise HandlerErrors(
                f"{first_failure_line(first)} (fail_fast: the drain stopped there)\n"
                + report.summary(),
                [first.exception],  # type: ignore[list-item]
                report,
            )

    def _refuse_strays(self) -> None:
        strays = self._strays()
        if strays:
            raise DrainError(stray_message(strays))

    def _async_poller(
        self, coroutines: Sequence[HandlerSpec], outbox: Outbox | None = None
    ) -> AsyncPoller:
        """The asyncio poller a drain runs, with a waiter of its own: a drain never waits, so
        it needs none of the store's (a ``LISTEN`` connection only ``run_forever`` closes)."""
        outbox = outbox or self.outbox
        store = outbox.store
        if not store.capabilities.asyncio:
            why = (
                f"async def handlers ({names(coroutines)}) run on the asyncio poller"
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
        for count in self._counts:
            count.deliveries += len(round_report.deliveries)

    def _advance_to_next(
        self, horizon: datetime | None, after_claim: bool = False, move: bool = True
    ) -> bool:
        """Move the clock to the next instant something falls due (not with ``move`` False);
        False when the drain is done.

        Something due now is polled for after a poll that claimed something (``after_claim``:
        a follow-up its handlers enqueued); after a poll that claimed nothing, nothing can be
        brought closer by the clock: a poll at the same instant would claim nothing again, and
        the drain would never end.
        """
        next_at = self._next_due(horizon)
        if next_at is None:
            return False
        if next_at <= self.clock.now():
            return after_claim
        if not move:
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
        selection = self._selection
        if selection.exhausted:
            return None
        events = self._events_after(0)
        self._seen = events
        for event in events:
            if event.available_at is None or not selection.wants(event):
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

    def _unexpected(self, report: DrainReport) -> list[Delivery]:
        return [
            d
            for d in report.failed
            if isinstance(d.exception, Exception) and not any(x.covers(d) for x in self._expected)
        ]

    def _raise_unexpected(self, report: DrainReport) -> None:
        unexpected = self._unexpected(report)
        if unexpected:
            excs: list[Exception] = [d.exception for d in unexpected]  # type: ignore[misc]
            more = f"; {len(unexpected)} unexpected failure(s) in all" if len(excs) > 1 else ""
            raise HandlerErrors(
                f"{first_failure_line(unexpected[0])}{more} (fail_fast=True stops at the "
                "first; raise_errors=False or expect_failures() for retry tests)\n"
                + report.summary(),
                excs,
                report,
            )

    def use_relay(self, relay: TestRelay, *names: str) -> TestRelay:
        """Every later drain publishes through ``relay`` in place of the app's relays (those
        named, or all), on the same topics and under the same names.

        Returns:
            ``relay``.

        Raises:
            ConfigurationError: the bus has no relay (of those names); checked now.
        """
        relay.bound(self.outbox, names or None)
        self._relay = (relay, names or None)
        return relay

    @contextlib.contextmanager
    def statements(self) -> Iterator[StatementCount]:
        """``with outbox_drain.statements() as s:`` - the SQL statements the delivery path ran
        in the block (``s.statements``, ``s.per_delivery``, ``s.by_handler``,
        ``s.assert_at_most(...)``); see ``outboxkit.testing.statements``.

        Yields:
            The ``StatementCount``, filled in as the block runs.
        """
        if self._tracker is None:
            self._tracker = HandlerTracker()
            self.outbox.add_observer(self._tracker)
        count = StatementCount()
        self._tracker.count = count
        self._counts.append(count)
        try:
            with counting(self.outbox.store, count):
                yield count
        finally:
            self._tracker.count = None
            self._counts.remove(count)

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

    def enqueued(self, topic: str | None = None, *, conn: Any = None) -> list[Event]:
        """Every event of the test store (any state, enqueued before or after the drain was
        made), optionally of one topic.

        Args:
            topic: only events of this topic (all when None).
            conn: read through the app's own connection, inside its open transaction: an
                event it enqueued and has not committed yet is there.

        Returns:
            The events, in enqueue order.

        Raises:
            ConfigurationError: ``conn`` cannot be read through on this store.
        """
        events = self._events_after(0) if conn is None else events_through(self.outbox.store, conn)
        return [e for e in events if e.id > self._since and (topic is None or e.topic == topic)]

    @property
    def window(self) -> str:
        """Which events the assertions look at, as their messages say it."""
        if not self._since:
            return "in the test store"
        return (
            f"enqueued since outbox_drain was set up (after event {self._since}: the outbox's "
            "store is not the outbox_store fixture's, so it may hold other tests' events)"
        )

    def assert_enqueued(
        self,
        topic: str,
        payload: Any = None,
        count: int | None = None,
        *,
        key: Any = UNSET,
        headers: Mapping[str, Any] | None = None,
        scheduled: datetime | timedelta | Matcher | None = None,
        conn: Any = None,
    ) -> list[Event]:
        """Some (or exactly ``count``) ``topic`` events of the test store that match.

        Looks at every event of the test store, whatever enqueued it and when (a fixture
        before the drain was made included). What matches counts as asserted:
        ``outboxkit_strict`` does not report it.

        Args:
            topic: the event topic.
            payload: a payload pattern: partial to any depth, with wildcards (``ANY``, a
                type, a regular expression, a ``Matcher``; see ``outboxkit.testing.matching``).
            count: exactly this many matches (at least one when None).
            key: the event's key (a value, None for no key, or a pattern).
            headers: a partial headers pattern.
            scheduled: when it falls due (``available_at``): an instant, a duration from the
                test clock's now, or a pattern.
            conn: read through the app's open transaction (see ``enqueued``).

        Returns:
            The matching events.

        Raises:
            AssertionError: listing the events of that topic, each with where it first differs.
        """
        __tracebackhide__ = True
        wanted = EventFilter(topic, payload, key, headers, scheduled, self.clock.now())
        window = self.window + (" (read through conn)" if conn is not None else "")
        strays = self._strays()
        return assert_enqueued(
            self.enqueued(topic, conn=conn),
            wanted,
            count,
            window,
            asserted=self._asserted,
            note=stray_message(strays) if strays else "",
        )

    def refute_enqueued(
        self,
        topic: str,
        payload: Any = None,
        *,
        key: Any = UNSET,
        headers: Mapping[str, Any] | None = None,
        scheduled: datetime | timedelta | Matcher | None = None,
        conn: Any = None,
    ) -> None:
        """No ``topic`` event of the test store matches (arguments as ``assert_enqueued``).

        Raises:
            AssertionError: listing the events that match.
        """
        __tracebackhide__ = True
        wanted = EventFilter(topic, payload, key, headers, scheduled, self.clock.now())
        refute_enqueued(self.enqueued(topic, conn=conn), wanted, self.window)

    @contextlib.contextmanager
    def capture(self, *, conn: Any = None) -> Iterator[Capture]:
        """``with drain.capture() as cap:`` - ``cap`` sees only what the block enqueued.

        Args:
            conn: the app's connection, when the block's enqueues are in a transaction still
                open on it: the block's bounds and events are read through it.

        Yields:
            The ``Capture``; it keeps what the block enqueued after the block ends.
        """
        cap = Capture(self.enqueued_through, self._asserted, self.clock.now, conn)
        try:
            yield cap
        finally:
            cap.close()

    def enqueued_through(self, conn: Any) -> list[Event]:
        """Every event of the test store, through ``conn`` when it is not None."""
        return self.enqueued(conn=conn)

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

    def unaccounted(self) -> list[Event]:
        """Events of the test store that were neither drained nor asserted.

        Returns:
            The events, in enqueue order (what ``outboxkit_strict`` fails a test for).
        """
        return [
            e
            for e in self._events_after(self._since)
            if e.id not in self._drained and e.id not in self._asserted
        ]
