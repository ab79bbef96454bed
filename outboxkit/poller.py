"""The poller: claim -> deliver -> settle, once (``run_once``) or in a loop (``run_forever``).

The poller is the shell around the pure core: it reads the clock, talks to the store, runs the
handlers, and asks ``_machine`` what each outcome means. The same code path runs in production and
inside ``outbox_drain`` in a test.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol

from ._machine import DeadLetter, Publish, Retry, Settlement, decide_settlement, lease_is_low
from ._model import (
    Claim,
    Claimed,
    DeadLettered,
    Event,
    HandlerFailed,
    HandlerRejected,
    HandlerSucceeded,
    LeaseLost,
    NewEvent,
    Outcome,
    Published,
    RetryScheduled,
    UndecodablePayload,
    Unrouted,
)
from ._options import PollerOptions
from ._payload import build_event
from ._text import describe_exception, storable
from .bus import HandlerSpec
from .errors import (
    ConfigurationError,
    HandlerCrashed,
    LeaseLostError,
    Reject,
    SchemaError,
    StoreError,
)

if TYPE_CHECKING:
    from .outbox import Outbox
    from .store import DeliveryTransaction

__all__ = ["Delivery", "PollReport", "Poller", "ThreadWaiter", "Waiter"]

log = logging.getLogger("outboxkit")

MAX_OUTAGE_WAIT = 30.0


class Waiter(Protocol):
    """How a poller waits between polls. ``wait`` returns early when ``wake`` is called."""

    def wait(self, timeout: float) -> None: ...

    def wake(self) -> None: ...


class ThreadWaiter:
    """The default waiter: a ``threading.Event`` that in-process enqueues set."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def wait(self, timeout: float) -> None:
        # Clear only a wake we consumed: one that lands after a timeout stays set for next time.
        if self._event.wait(timeout):
            self._event.clear()

    def wake(self) -> None:
        self._event.set()


@dataclass(frozen=True, slots=True)
class Delivery:
    """One handler run: what happened, when, on which attempt."""

    event_id: int
    topic: str
    handler: str
    attempt: int
    outcome: Outcome
    at: datetime
    error: str | None = None
    exception: BaseException | None = field(default=None, compare=False, repr=False)


@dataclass(slots=True)
class PollReport:
    """What one ``run_once`` did. Event ids per result; every handler run in ``deliveries``."""

    claimed: list[int] = field(default_factory=list)
    published: list[int] = field(default_factory=list)
    retried: list[int] = field(default_factory=list)
    dead_lettered: list[int] = field(default_factory=list)
    lease_lost: list[int] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)

    @property
    def rejected(self) -> list[Delivery]:
        return [d for d in self.deliveries if d.outcome is Outcome.REJECTED]

    @property
    def failed(self) -> list[Delivery]:
        return [d for d in self.deliveries if d.outcome is Outcome.FAILED]

    def __bool__(self) -> bool:
        return bool(self.claimed)


class _Context:
    """The ``ctx`` a handler receives (see ``outboxkit.bus.DeliveryContext``)."""

    __slots__ = ("_buffer", "_max_payload_bytes", "_tx", "attempt", "handler")

    def __init__(self, handler: str, attempt: int, max_payload_bytes: int) -> None:
        self.handler = handler
        self.attempt = attempt
        self._max_payload_bytes = max_payload_bytes
        self._tx: DeliveryTransaction | None = None
        self._buffer: list[NewEvent] = []

    @property
    def connection(self) -> Any:
        return self._tx.connection if self._tx is not None else None

    def enqueue(
        self,
        topic: str,
        payload: Any,
        *,
        headers: Mapping[str, str] | None = None,
        key: str | None = None,
        delay: float | timedelta | None = None,
    ) -> None:
        event = build_event(
            topic,
            payload,
            headers=headers,
            key=key,
            delay=delay,
            max_payload_bytes=self._max_payload_bytes,
        )
        if self._tx is not None:
            self._tx.enqueue([event])
        else:
            # Non-transactional handler: the follow-up commits with its delivery record.
            self._buffer.append(event)


class _Ops(Protocol):
    """Where one round's deliveries, settlements and lease extensions go: the store itself
    (``transaction="per_event"``) or the batch's transaction (``"per_batch"``)."""

    def delivery(
        self, claim: Claim, *, now: datetime | None
    ) -> AbstractContextManager[DeliveryTransaction]: ...

    def settle(
        self, claim: Claim, settlement: Settlement, *, error: str | None, now: datetime | None
    ) -> bool: ...

    def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]: ...


# What the last delivery of an event settles it as, given that delivery's outcome.
_Decide = Callable[[Outcome], tuple[Settlement, str | None]]
_Settled = tuple[Claim, Settlement, str | None]


@dataclass(slots=True)
class _Round:
    """One ``process`` call's state.

    Attributes:
        ops: where deliveries, settlements and extensions go (the store, or the batch).
        remaining: claims not started yet, in order.
        deadlines: token -> the local lease deadline.
        report: what happened.
        written: settlements written but not committed yet (a batch): announced at its commit.
        pending: settlements not written yet (a store with ``batched_settle``): written
            together, with one ``settle_many``, when the round ends.
    """

    ops: _Ops
    remaining: list[Claim]
    deadlines: dict[str, datetime]
    report: PollReport
    written: list[_Settled] | None = None
    pending: list[_Settled] | None = None


class _HandlerError(Exception):
    """Wraps an exception a handler raised, to keep it apart from the store's own errors."""

    def __init__(self, exc: Exception) -> None:
        super().__init__(exc)
        self.exc = exc


class Poller:
    """Claims due events and delivers them. Make one with ``Outbox.poller(**options)``.

    Thread-safe to ``stop()`` from another thread or a signal handler.
    """

    def __init__(self, outbox: Outbox, options: PollerOptions, *, waiter: Waiter | None) -> None:
        self.outbox = outbox
        self.options = options
        # Without a waiter given, the store may offer one that also wakes on commits in other
        # processes (``make_waiter``, see ``outboxkit.store``); this poller then closes it.
        self._owns_waiter = waiter is None
        if waiter is None:
            make_waiter = getattr(outbox.store, "make_waiter", None)
            waiter = make_waiter() if callable(make_waiter) else None
        self.waiter: Waiter = waiter if waiter is not None else ThreadWaiter()
        self._stop = threading.Event()
        capabilities = outbox.store.capabilities
        self._batched = options.transaction == "per_batch"
        if self._batched and "batched_delivery" not in capabilities:
            raise ConfigurationError(
                f"transaction='per_batch' needs a store with the 'batched_delivery' capability; "
                f"{outbox.store!r} has {sorted(capabilities)}"
            )
        # How events are settled, cheapest first for the store at hand: a store with
        # batched_settle settles the round's events together when the round ends (per event:
        # after the last delivery, so each delivery's commit stays small; in a batch: in the
        # batch's transaction, before it commits); else, where the store can, in the
        # transaction (or savepoint) of the event's last delivery; else on its own.
        self._defer = "batched_settle" in capabilities
        self._fold = not self._defer and "settle_in_delivery" in capabilities

    def __repr__(self) -> str:
        o = self.options
        return (
            f"Poller(batch_size={o.batch_size}, lease={o.lease.total_seconds()}s, "
            f"interval={o.interval.total_seconds()}s, max_retries={o.max_retries}, "
            f"transaction={o.transaction!r})"
        )

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        """Stop gracefully: finish the event in hand, release the leases of the rest."""
        self._stop.set()
        self.waiter.wake()

    # -- one round --------------------------------------------------------------------------------

    def run_once(self) -> PollReport:
        """Claim one batch, deliver every event in claim order, settle each (R3-R13).

        Returns:
            What happened, event by event and handler by handler.

        Raises:
            StoreError: the store failed (a database failure is never blamed on a handler).
            BaseException: re-raised from a handler (KeyboardInterrupt, SystemExit) after
                releasing the events not yet started; the event in hand recovers by its lease.
        """
        outbox = self.outbox
        started_at = outbox.local_clock.now()
        claims = outbox.store.claim(
            batch_size=self.options.batch_size, lease=self.options.lease, now=outbox.store_now()
        )
        return self.process(claims, claimed_at=started_at)

    def process(self, claims: Sequence[Claim], *, claimed_at: datetime) -> PollReport:
        """Deliver and settle claims this poller just made (``run_once`` without the claim).

        Args:
            claims: fresh claims, in claim order.
            claimed_at: the outbox's ``local_clock`` instant just before the claim (lease
                deadlines count from it).
        """
        report = PollReport()
        outbox = self.outbox
        lease = self.options.lease
        if not claims:
            return report
        # The local lease deadline: from just before the claim, so never later than the store's.
        deadlines = {c.token: claimed_at + lease for c in claims}
        for claim in claims:
            report.claimed.append(claim.event.id)
            outbox.emit(Claimed(claim.event.id, claim.event.topic, claim.attempt))
        rnd = _Round(outbox.store, list(claims), deadlines, report)
        try:
            rnd.pending = [] if self._defer else None
            if self._batched:
                rnd.written = []
                with outbox.store.batch(now=outbox.store_now()) as batch:  # type: ignore[attr-defined]
                    rnd.ops = batch
                    if not callable(getattr(batch, "settle_many", None)):
                        rnd.pending = None  # a batch without it: each event settled on its own
                    self._deliver_all(rnd)
                    if rnd.pending:  # in the batch's transaction: void if it rolls back
                        self._settle_pending(rnd)
                # Committed: only now are the batch's settlements true.
                for claim, settlement, error in rnd.written:
                    self._announce(claim, settlement, error, report)
            else:
                try:
                    self._deliver_all(rnd)
                finally:
                    if rnd.pending:
                        self._settle_pending(rnd)
        finally:
            # Stopping, or a handler raised BaseException: hand back the unstarted claims (after
            # a batch has ended: its transaction may hold their rows).
            if rnd.remaining:
                released = outbox.store.release(rnd.remaining, now=outbox.store_now())
                report.released.extend(c.event.id for c in rnd.remaining)
                log.info("poller stopping: released %d unstarted claim(s)", released)
        return report

    def _deliver_all(self, rnd: _Round) -> None:
        """Deliver ``rnd.remaining`` in order, popping each as it starts; stop early when asked
        (what is left is then released by the caller)."""
        while rnd.remaining and not self._stop.is_set():
            claim = rnd.remaining.pop(0)
            self._process(rnd, claim)

    def _settle_pending(self, rnd: _Round) -> None:
        """Write the round's deferred settlements in one ``settle_many`` (R8, each fenced by
        its token) through the round's store or batch, then announce them (a batch's once it
        commits)."""
        pending = rnd.pending or []
        ops: Any = rnd.ops
        done = ops.settle_many(pending, now=self.outbox.store_now())
        for (claim, settlement, error), ok in zip(pending, done, strict=True):
            if not ok:
                self._lease_lost(claim, rnd.report, None)
            elif rnd.written is not None:
                rnd.written.append((claim, settlement, error))
            else:
                self._announce(claim, settlement, error, rnd.report)
        pending.clear()

    def _process(self, rnd: _Round, claim: Claim) -> None:
        outbox = self.outbox
        report = rnd.report
        event = claim.event
        specs = outbox.bus.handlers_for(event.topic)
        subscribed = [s.name for s in specs]
        outcomes: dict[str, Outcome] = dict(claim.done)
        errors: list[str] = []
        if not specs:
            log.info("event %d: no handler subscribed to %r; publishing it", event.id, event.topic)
            outbox.emit(Unrouted(event.id, event.topic))
        if isinstance(event.payload, UndecodablePayload):
            # Retrying cannot fix a payload that is not JSON: dead-letter it at once.
            self._apply(rnd, claim, DeadLetter(), event.payload.error)
            return
        if claim.attempt > self.options.max_retries + 1:
            # R4 + R11: earlier attempts crashed or lost their lease without settling and used
            # every attempt up. Run nothing (a poison event must not crash pollers forever);
            # settle it as it stands: published if every handler is recorded, else dead.
            error = f"attempts used up: attempt {claim.attempt - 1} crashed or lost its lease"
            self._apply(rnd, claim, self._decide(claim, subscribed, outcomes), error)
            return
        to_run = [spec for spec in specs if spec.name not in outcomes]  # R5: recorded ones
        for n, spec in enumerate(to_run):
            # R13: keep the batch's leases alive; never start a handler once ours is gone.
            if not self._keep_lease(rnd, claim):
                return
            decide: _Decide | None = None
            if self._fold and n == len(to_run) - 1:
                # The last delivery settles the event in its own transaction.
                decide = self._decider(claim, subscribed, outcomes, errors, spec.name)
            delivery, written = self._deliver(rnd.ops, claim, spec, decide)
            report.deliveries.append(delivery)
            if delivery.outcome is Outcome.CRASHED:  # lease lost mid-delivery
                self._lease_lost(claim, report, spec.name)
                return
            outcomes[spec.name] = delivery.outcome
            if written is not None:
                reason = _joined(errors)
                if rnd.written is not None:  # a batch: announced once it commits
                    rnd.written.append((claim, written, reason))
                else:
                    self._announce(claim, written, reason, report)
                return
            if delivery.outcome is Outcome.FAILED:
                errors.append(f"{spec.name}: {delivery.error}")
        settlement = self._decide(claim, subscribed, outcomes)
        self._apply(rnd, claim, settlement, _joined(errors))

    def _decider(
        self,
        claim: Claim,
        subscribed: Sequence[str],
        outcomes: Mapping[str, Outcome],
        errors: Sequence[str],
        handler: str,
    ) -> _Decide:
        """How the delivery of ``handler`` settles the event, whichever way it ends."""

        def decide(outcome: Outcome) -> tuple[Settlement, str | None]:
            settlement = self._decide(claim, subscribed, {**outcomes, handler: outcome})
            return settlement, _joined(errors)

        return decide

    def _decide(
        self, claim: Claim, subscribed: Sequence[str], outcomes: Mapping[str, Outcome]
    ) -> Settlement:
        return decide_settlement(
            subscribed=subscribed,
            outcomes=outcomes,
            attempts=claim.attempt,
            max_retries=self.options.max_retries,
            backoff=self.options.backoff,
        )

    def _keep_lease(self, rnd: _Round, claim: Claim) -> bool:
        outbox = self.outbox
        deadlines, rest, report = rnd.deadlines, rnd.remaining, rnd.report
        now = outbox.local_clock.now()  # a local deadline: monotonic in production
        lease = self.options.lease
        if not lease_is_low(remaining=deadlines[claim.token] - now, lease=lease):
            return True
        if now >= deadlines[claim.token]:
            self._lease_lost(claim, report, None)
            return False
        # Events delivered but waiting for the round's settle_many keep their leases too.
        waiting = [c for c, _, _ in rnd.pending or ()]
        batch = [claim, *rest, *waiting]
        kept = {c.token for c in rnd.ops.extend(batch, lease=lease, now=outbox.store_now())}
        for c in batch:
            if c.token in kept:
                deadlines[c.token] = now + lease
        lost = [c for c in rest if c.token not in kept]
        for c in lost:
            rest.remove(c)
            self._lease_lost(c, report, None)
        if claim.token not in kept:
            self._lease_lost(claim, report, None)
            return False
        return True

    def _deliver(
        self, ops: _Ops, claim: Claim, spec: HandlerSpec, decide: _Decide | None
    ) -> tuple[Delivery, Settlement | None]:
        """Run one handler for one claimed event, with its record (R6, R7).

        With ``decide``, a succeeded or rejected delivery also settles the event in its own
        transaction; the settlement written is returned with the delivery.
        """
        outbox = self.outbox
        event = claim.event
        now = outbox.store_now()
        ctx = _Context(spec.name, claim.attempt, outbox.max_payload_bytes)
        at = outbox.clock.now()
        settled: Settlement | None = None

        def finish(tx: DeliveryTransaction, outcome: Outcome, reason: str | None = None) -> None:
            nonlocal settled
            tx.record(spec.name, outcome, reason=reason)
            if decide is not None:
                settlement, error = decide(outcome)
                tx.settle(settlement, error=error)  # type: ignore[attr-defined]
                settled = settlement

        try:
            if spec.transactional:
                with ops.delivery(claim, now=now) as tx:
                    ctx._tx = tx
                    _call(spec, event, ctx)
                    finish(tx, Outcome.SUCCEEDED)
            else:
                _call(spec, event, ctx)
                # The record's transaction opens after the handler ran: stamp it (and the
                # follow-ups' delays) with that instant, as a database clock would.
                with ops.delivery(claim, now=outbox.store_now()) as tx:
                    if ctx._buffer:
                        tx.enqueue(ctx._buffer)
                    finish(tx, Outcome.SUCCEEDED)
        except Reject as rejection:
            reason = storable(rejection.reason)
            settled = None
            try:
                with ops.delivery(claim, now=outbox.store_now()) as tx:
                    finish(tx, Outcome.REJECTED, reason)
            except LeaseLostError:
                return self._delivery(claim, spec, Outcome.CRASHED, at, "lease lost"), None
            log.info("event %d: %s rejected it: %s", event.id, spec.name, reason)
            outbox.emit(HandlerRejected(event.id, event.topic, spec.name, claim.attempt, reason))
            return self._delivery(claim, spec, Outcome.REJECTED, at, reason), settled
        except LeaseLostError:
            return self._delivery(claim, spec, Outcome.CRASHED, at, "lease lost"), None
        except (_HandlerError, HandlerCrashed) as failure:
            exc: Exception = failure.exc if isinstance(failure, _HandlerError) else failure
            error = describe_exception(exc)
            log.warning(
                "event %d (%s): handler %s failed on attempt %d: %s",
                event.id,
                event.topic,
                spec.name,
                claim.attempt,
                error,
                exc_info=exc,
            )
            outbox.emit(HandlerFailed(event.id, event.topic, spec.name, claim.attempt, error))
            return self._delivery(claim, spec, Outcome.FAILED, at, error, exc), None
        outbox.emit(HandlerSucceeded(event.id, event.topic, spec.name, claim.attempt))
        return self._delivery(claim, spec, Outcome.SUCCEEDED, at), settled

    @staticmethod
    def _delivery(
        claim: Claim,
        spec: HandlerSpec,
        outcome: Outcome,
        at: datetime,
        error: str | None = None,
        exc: BaseException | None = None,
    ) -> Delivery:
        return Delivery(
            event_id=claim.event.id,
            topic=claim.event.topic,
            handler=spec.name,
            attempt=claim.attempt,
            outcome=outcome,
            at=at,
            error=error,
            exception=exc,
        )

    def _apply(self, rnd: _Round, claim: Claim, settlement: Settlement, error: str | None) -> None:
        """Write the settlement (R8, fenced by the token), then announce it; in a batch the
        announcement waits for the batch's commit; with ``batched_settle`` the write waits for
        the end of the round."""
        if rnd.pending is not None:
            rnd.pending.append((claim, settlement, error))
        elif not rnd.ops.settle(claim, settlement, error=error, now=self.outbox.store_now()):
            self._lease_lost(claim, rnd.report, None)
        elif rnd.written is not None:
            rnd.written.append((claim, settlement, error))
        else:
            self._announce(claim, settlement, error, rnd.report)

    def _announce(
        self, claim: Claim, settlement: Settlement, error: str | None, report: PollReport
    ) -> None:
        """Report and emit a settlement that has been committed."""
        outbox = self.outbox
        event = claim.event
        if isinstance(settlement, Publish):
            report.published.append(event.id)
            outbox.emit(Published(event.id, event.topic, claim.attempt))
        elif isinstance(settlement, Retry):
            report.retried.append(event.id)
            log.info(
                "event %d (%s): retry %d in %ss",
                event.id,
                event.topic,
                settlement.retry,
                settlement.delay.total_seconds(),
            )
            outbox.emit(
                RetryScheduled(event.id, event.topic, claim.attempt, settlement.delay, error)
            )
        elif isinstance(settlement, DeadLetter):
            report.dead_lettered.append(event.id)
            log.warning(
                "event %d (%s): dead-lettered after %d attempt(s): %s",
                event.id,
                event.topic,
                claim.attempt,
                error,
            )
            outbox.emit(DeadLettered(event.id, event.topic, claim.attempt, error))

    def _lease_lost(self, claim: Claim, report: PollReport, handler: str | None) -> None:
        log.warning(
            "event %d (%s): lease lost on attempt %d; another poller may own it",
            claim.event.id,
            claim.event.topic,
            claim.attempt,
        )
        report.lease_lost.append(claim.event.id)
        self.outbox.emit(LeaseLost(claim.event.id, claim.event.topic, claim.attempt, handler))

    # -- the loop ---------------------------------------------------------------------------------

    def run_forever(self) -> None:
        """Poll until :meth:`stop` is called: at ``interval`` when idle, at once when busy.

        A database outage is logged once, waited out with backoff, and its end logged; the
        loop goes on. A ``SchemaError`` (missing or incompatible schema) is raised at once.
        Published events older than the outbox's ``retain_published`` are pruned at most once
        a minute (``Outbox.prune_if_due``).

        Raises:
            SchemaError: the store's schema is missing or incompatible.
        """
        interval = self.options.interval.total_seconds()
        outage_since: int | None = None
        failures = 0
        self.outbox.add_waiter(self.waiter)
        try:
            while not self._stop.is_set():
                try:
                    report = self.run_once()
                except SchemaError:
                    raise
                except StoreError as exc:
                    failures += 1
                    if outage_since is None:
                        outage_since = failures
                        log.error("store unavailable, retrying with backoff: %s", exc)
                    self.waiter.wait(min(interval * 2.0 ** min(failures, 16), MAX_OUTAGE_WAIT))
                    continue
                if outage_since is not None:
                    log.warning("store available again after %d failed poll(s)", failures)
                    outage_since = None
                    failures = 0
                self.outbox.prune_if_due()  # retention: at most once a minute, logs its failures
                if len(report.claimed) < self.options.batch_size and not self._stop.is_set():
                    self.waiter.wait(interval)
        finally:
            self.outbox.remove_waiter(self.waiter)
            close = getattr(self.waiter, "close", None)
            if self._owns_waiter and callable(close):
                close()


def _joined(errors: Sequence[str]) -> str | None:
    """An event's ``last_error``: its handlers' errors in one storable line."""
    return storable("; ".join(errors)) if errors else None


def _call(spec: HandlerSpec, event: Event, ctx: _Context) -> None:
    try:
        spec.fn(event, ctx)
    except Reject:
        raise
    except Exception as exc:
        raise _HandlerError(exc) from exc
