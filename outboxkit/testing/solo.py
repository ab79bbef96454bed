"""``deliver_one``: one handler alone on a new event, through the real delivery path, or inside
the caller's own open transaction (``conn=``, with the ``attempt`` the handler sees); the
drain's methods for it, a base of ``Drain``."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from .. import calls
from ..bus import EventBus, HandlerSpec
from ..clock import FrozenClock
from ..core.model import Claim, Delivery, Outcome, PollReport
from ..errors import ConfigurationError, HandlerCrashed, Reject
from ..outbox import Message, Outbox
from ..reports import NO_SCOPE, HandlerError
from ..storekit.sql import SQLStore
from .loops import closing, on_a_loop_of_its_own, refuse_running_loop
from .report import DrainReport
from .through import database_of, driver_connection, events_through, store_database

if TYPE_CHECKING:
    from ..store import DeliveryTransaction

if TYPE_CHECKING:
    from ..aio import AsyncPoller

SAVEPOINT = "SAVEPOINT outboxkit_deliver_one"
RELEASE = "RELEASE SAVEPOINT outboxkit_deliver_one"
ROLLBACK = "ROLLBACK TO SAVEPOINT outboxkit_deliver_one"

__all__ = ["DeliverOne"]


class DeliverOne:
    """``deliver_one`` and ``deliver_one_async`` (``Drain`` has them)."""

    outbox: Outbox
    clock: FrozenClock
    _drained: set[int]

    def _async_poller(
        self, coroutines: Sequence[HandlerSpec], outbox: Outbox | None = None
    ) -> AsyncPoller:
        raise NotImplementedError

    def _raise_unexpected(self, report: DrainReport) -> None:
        raise NotImplementedError

    def deliver_one(
        self,
        handler: str,
        payload: Any,
        *,
        headers: Mapping[str, str] | None = None,
        raise_errors: bool = True,
        conn: Any = None,
        attempt: int | None = None,
    ) -> DrainReport:
        """Run one handler alone on a new event, through the real delivery path, or inside the
        caller's open transaction (``conn=``).

        Without ``conn``, the event is enqueued on the handler's topic and drained by an outbox
        whose bus holds only that handler; events already waiting are left untouched (their
        leases are not taken: the event is delivered before them by being claimed alone). An
        ``async def`` handler is run by the asyncio poller on an event loop of the drain's own;
        in an ``async def`` test, await :meth:`deliver_one_async` instead.

        With ``conn`` (the app's connection in its open transaction: a ``sqlite3`` or
        ``psycopg`` connection, a SQLAlchemy ``Session``/``Connection``, Django's connection,
        or a memory store's transaction), everything happens in that transaction and nothing
        is committed: the event is enqueued through ``conn``, a transactional handler gets
        ``conn``'s connection as ``ctx.connection`` inside a savepoint (a failure or a
        ``Reject`` rolls its writes back, and only them), its follow-ups are enqueued through
        ``conn`` when it succeeds, and ``ctx.attempt`` is ``attempt``. The test then asserts on
        the handler's writes (``assert_enqueued(..., conn=conn)`` for the follow-ups) and rolls
        its transaction back. No claim, lease or delivery record is made: those are the
        poller's, which ``deliver_one`` without ``conn`` runs.

        Args:
            handler: the handler's name on the outbox's bus.
            payload: the new event's payload.
            headers: the new event's headers.
            raise_errors: raise the handler's exception (as ``HandlerErrors``) unless expected.
            conn: run in this open transaction of the caller's instead (see above).
            attempt: the attempt the handler sees (``ctx.attempt``, 1 for the first run); only
                with ``conn``: through the real path the attempt is the store's own count (a
                drain with ``expect_failures`` reaches a later one).

        Returns:
            A one-round ``DrainReport`` (with ``conn``: the event claimed and delivered, never
            settled).

        Raises:
            ConfigurationError: no handler (or several) of that name; an async handler on a
                store without an asyncio side; with ``conn``, an ``async def`` handler, a
                ``conn`` on another database than the test store's (naming both), or a bad
                ``attempt`` (naming it).
            DrainError: an async handler while an event loop is running in this thread.
            HandlerErrors: the handler failed and ``raise_errors`` is true.
            HandlerCrashed: with ``conn``, the handler ended the caller's transaction.
        """
        spec = self.outbox.bus.find(handler)
        if conn is not None:
            return self._deliver_in(conn, spec, payload, headers, attempt, raise_errors)
        if attempt is not None:
            raise ConfigurationError(
                f"deliver_one(attempt={attempt!r}) needs conn=: through the real delivery path "
                "the attempt is the store's count (drain with expect_failures() to reach a "
                "later one)"
            )
        if calls.is_coroutine_function(spec.fn):
            refuse_running_loop(
                f"outbox_drain.deliver_one() runs the async def handler {spec.name!r} on an "
                "event loop of its own, and one is running here: in an async def test, use "
                "`report = await outbox_drain.deliver_one_async(...)`"
            )
        solo = self._solo(spec)
        if calls.is_coroutine_function(spec.fn):
            poller = self._async_poller([spec], solo)  # refusals before anything is written
            event_id, ours, claimed_at = self._claim_alone(solo, spec, payload, headers)
            round_report = on_a_loop_of_its_own(
                closing(poller, poller.process(ours, claimed_at=claimed_at))
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

    # -- inside the caller's transaction ----------------------------------------------------------

    def _deliver_in(
        self,
        conn: Any,
        spec: HandlerSpec,
        payload: Any,
        headers: Mapping[str, str] | None,
        attempt: int | None,
        raise_errors: bool,
    ) -> DrainReport:
        """``deliver_one(conn=...)``: the handler run in the caller's open transaction."""
        if attempt is None:
            attempt = 1
        if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
            raise ConfigurationError(f"attempt must be an integer >= 1, got {attempt!r:.80}")
        if calls.is_coroutine_function(spec.fn):
            raise ConfigurationError(
                f"deliver_one(conn=...) runs blocking handlers in the caller's transaction; "
                f"{spec.name!r} is async def: deliver it with deliver_one() or "
                "deliver_one_async() without conn="
            )
        store = self.outbox.store
        connection = driver_connection(conn) if isinstance(store, SQLStore) else conn
        ours, theirs = store_database(store), database_of(connection)
        if ours is not None and theirs is not None and ours != theirs:
            raise ConfigurationError(
                f"deliver_one(conn=...): conn is on {theirs}, the test store on {ours}; pass a "
                "connection to the test store's database"
            )
        if not _in_a_transaction(connection):
            raise ConfigurationError(
                f"deliver_one(conn=...) runs in the caller's open transaction, and {conn!r:.80} "
                "is in none (autocommit): begin one first (with conn.transaction(), or a "
                "connection that opens one on its first statement)"
            )
        (event_id,) = self.outbox.enqueue_many(
            conn, [Message(spec.topic, payload, headers=headers)]
        )
        (stored,) = [e for e in events_through(store, conn) if e.id == event_id]
        event = dataclasses.replace(stored, attempts=attempt)  # as a claim counts it
        ctx = self.outbox.runtime().contexts
        ctx.refresh()
        context = ctx.make(spec.name, attempt)
        outcome, error, exception = Outcome.SUCCEEDED, None, None
        try:
            with _savepoint(connection, spec) if spec.transactional else _nothing():
                if spec.transactional:
                    context.bind(cast("DeliveryTransaction", _CallerTransaction(connection)))
                calls.call(spec, event, context, NO_SCOPE)
                if context.buffer:
                    self.outbox.enqueue_many(conn, [_message(new) for new in context.buffer])
        except Reject as rejection:
            outcome, error = Outcome.REJECTED, calls.reason_of(rejection)
        except HandlerError as failed:
            cause = failed.__cause__ if failed.__cause__ is not None else failed
            outcome, error, exception = Outcome.FAILED, f"{type(cause).__name__}: {cause}", cause
        delivery = Delivery(
            event_id, spec.topic, spec.name, attempt, outcome, self.clock.now(), error, exception
        )
        round_report = PollReport(claimed=[event_id], deliveries=[delivery])
        return self._one(round_report, event_id, spec, raise_errors)


def _in_a_transaction(connection: Any) -> bool:
    """``connection`` is in a transaction, or opens one on its next statement (a DB-API
    connection out of autocommit); True for a connection this cannot tell about."""
    if isinstance(connection, sqlite3.Connection):
        return connection.in_transaction or connection.isolation_level is not None
    if type(connection).__module__.startswith("psycopg"):
        from psycopg.pq import TransactionStatus

        status = connection.info.transaction_status
        return status == TransactionStatus.INTRANS or (
            status == TransactionStatus.IDLE and not connection.autocommit
        )
    return True


class _CallerTransaction:
    """What a handler's ``ctx`` is bound to under ``deliver_one(conn=...)``: the caller's
    connection (its writes stay in the caller's transaction)."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection


@contextmanager
def _nothing() -> Iterator[None]:
    yield


@contextmanager
def _savepoint(connection: Any, spec: HandlerSpec) -> Iterator[None]:
    """A savepoint in the caller's transaction around one handler run: rolled back to when the
    handler raises, so its writes go and the caller's stay.

    Raises:
        HandlerCrashed: the handler ended the caller's transaction (committed or rolled back).
    """
    from ..memory import MemoryTransaction

    if isinstance(connection, MemoryTransaction):
        mark = connection.pending.mark()
        try:
            yield
        except BaseException:
            if connection.open:
                connection.pending.roll_back_to(mark)
            raise
        if not connection.open:
            raise _ended(spec)
        return
    _execute(connection, SAVEPOINT, spec)
    try:
        yield
    except BaseException:
        _execute(connection, ROLLBACK, spec)
        _execute(connection, RELEASE, spec)
        raise
    _execute(connection, RELEASE, spec)


def _execute(connection: Any, statement: str, spec: HandlerSpec) -> None:
    try:
        cursor = connection.cursor()
        try:
            cursor.execute(statement)
        finally:
            cursor.close()
    except Exception as exc:  # the savepoint is gone: the handler ended the transaction
        raise _ended(spec) from exc


def _ended(spec: HandlerSpec) -> HandlerCrashed:
    return HandlerCrashed(
        f"handler {spec.name!r} ended the caller's transaction (committed or rolled back) "
        "under deliver_one(conn=...); a handler never ends its delivery transaction"
    )


def _message(new: Any) -> Message:
    """A follow-up the handler enqueued (a ``NewEvent``), as the caller enqueues one."""
    return Message(
        new.topic,
        json.loads(new.payload_json),
        headers=new.headers,
        key=new.key,
        delay=new.delay,
        dedupe_key=new.dedupe_key,
        available_at=new.available_at,
    )
