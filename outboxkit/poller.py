"""The blocking poller: claim -> deliver -> settle, once (``run_once``) or in a loop.

A thin shell over the pure core: ``outboxkit.core.batch.ClaimedBatch`` says what comes next and
``outboxkit.core.machine`` decides every outcome; ``outboxkit.handling`` reports them. This
module only waits: for the store and for the handlers. ``outboxkit.aio`` is the same shell for
asyncio, name for name. The same code path runs in production and inside ``outbox_drain``.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, cast

from . import handling
from .bus import HandlerSpec
from .core.batch import ClaimedBatch, EventRun
from .core.machine import (
    MAX_OUTAGE_WAIT,
    LeaseCheck,
    check_lease,
    lost_of,
    outage_delay,
    prefetches,
)
from .core.model import Claim, Delivery, Event, Outcome, PollReport
from .core.options import PollerOptions
from .errors import (
    HandlerCrashed,
    LeaseLostError,
    Reject,
    SchemaError,
    StoreError,
)
from .store import BatchTransaction, Deliveries
from .waiter import ClosingWaiter, ThreadWaiter, Waiter

if TYPE_CHECKING:
    from .outbox import Outbox

__all__ = [
    "MAX_OUTAGE_WAIT",
    "Delivery",
    "PollReport",
    "Poller",
    "ThreadWaiter",
    "Waiter",
    "check_handlers",
]

log = logging.getLogger("outboxkit")

check_handlers = handling.check_handlers


class Poller(handling.Shell):
    """Claims due events and delivers them. Make one with ``Outbox.poller(**options)``.

    Thread-safe to ``stop()`` from another thread or a signal handler.

    ``concurrency`` (per event): how many deliveries may be committing at once. The handlers
    run one at a time, in claim order; on a store with rounds of its own (``Store.rounds``:
    PostgreSQL) the record of a delivery that needs no transaction of its own is sent without
    waiting for its commit, on up to ``concurrency`` connections in turn, and every answer is
    read before the round's settlement. Elsewhere it changes nothing.

    Raises:
        ConfigurationError: ``transaction="per_batch"`` on a store without batches, or with
            ``concurrency`` above 1; ``concurrency`` not from 1 to ``MAX_CONCURRENCY``; an
            ``async def`` handler on the bus.
    """

    def __init__(
        self,
        outbox: Outbox,
        options: PollerOptions,
        *,
        waiter: Waiter | None,
        concurrency: int = 1,
    ) -> None:
        super().__init__(outbox, options, concurrency)
        handling.check_handlers(outbox.bus.specs(), asyncio=False)
        # Without a waiter given, the store may offer one that also wakes on commits in other
        # processes; this poller then closes it when run_forever ends.
        self._owned: ClosingWaiter | None = None
        if waiter is None:
            self._owned = outbox.store.make_waiter()
        self.waiter: Waiter = waiter or self._owned or ThreadWaiter()
        self._prefetcher: _Prefetcher | None = None  # the loop's, while it runs

    # -- one round ------------------------------------------------------------------------------

    def run_once(self) -> PollReport:
        """Claim one batch, deliver every event in claim order, settle each (R3-R13).

        Returns:
            What happened, event by event and handler by handler.

        Raises:
            StoreError: the store failed (a database failure is never blamed on a handler).
            BaseException: re-raised from a handler (KeyboardInterrupt, SystemExit) after
                releasing the events not yet started; the event in hand recovers by its lease.
        """
        claimed_at, claims = self._claim()
        return self.process(claims, claimed_at=claimed_at)

    def _claim(self) -> tuple[datetime, list[Claim]]:
        """One claim (R3), and the local-clock instant just before it (the leases count from
        it)."""
        outbox = self.outbox
        claimed_at = outbox.local_clock.now()
        claims = outbox.store.claim(
            batch_size=self.options.batch_size,
            lease=self.options.lease,
            now=outbox.store_now(),
            dead_key=outbox.dead_key,
        )
        return claimed_at, claims

    def _round(self, prefetcher: _Prefetcher | None) -> PollReport:
        """One round of the loops: ``run_once``, or with ``prefetch`` the claim made while the
        last batch was delivered, the next one made while this one is (``prefetches``), its
        leases kept alive meanwhile (``_keep_lease``)."""
        self._prefetcher = prefetcher
        prefetched = None if prefetcher is None else prefetcher.take()
        if prefetched is not None and prefetched[1]:
            claimed_at, claims = prefetched
        else:  # none made, or an empty one: the last batch's follow-ups may be due since
            claimed_at, claims = self._claim()
        if prefetcher is not None and prefetches(
            enabled=not self._stop.is_set(), claimed=len(claims), batch_size=self.options.batch_size
        ):
            prefetcher.start()
        return self.process(claims, claimed_at=claimed_at)

    @contextmanager
    def _prefetching(self) -> Iterator[_Prefetcher | None]:
        """The loops' prefetcher (None without ``prefetch``); what it holds when the loop ends is
        released."""
        if not self._prefetch:
            yield None
            return
        prefetcher = _Prefetcher(self)
        try:
            yield prefetcher
        finally:
            prefetcher.close()

    def process(self, claims: Sequence[Claim], *, claimed_at: datetime) -> PollReport:
        """Deliver and settle claims this poller just made (``run_once`` without the claim).

        Args:
            claims: fresh claims, in claim order.
            claimed_at: the outbox's ``local_clock`` instant just before the claim (lease
                deadlines count from it).
        """
        batch = self._claimed(claims, claimed_at)
        if not claims:
            return batch.report
        outbox = self.outbox
        try:
            with self._deliveries() as deliveries:
                try:
                    self._deliver_all(deliveries, batch)
                finally:
                    # Per event, what was settled is written even when a handler raised a
                    # BaseException; in a batch, only if the batch goes on to commit.
                    if not self._batched:
                        self._write(deliveries, batch)
                if self._batched:
                    self._write(deliveries, batch)
            handling.announce(outbox, batch.committed())
        finally:
            # Stopping, or a handler raised BaseException: hand back the unstarted claims
            # (after a batch has ended: its transaction may hold their rows).
            unstarted = batch.unstarted()
            if unstarted:
                released = outbox.store.release(unstarted, now=outbox.store_now())
                log.info("poller stopping: released %d unstarted claim(s)", released)
        return batch.final_report()

    @contextmanager
    def _deliveries(self) -> Iterator[Deliveries]:
        """Where the round's deliveries go: a batch transaction, or per event the store's
        round (``Store.rounds``: the store itself, unless it keeps a round's own context)."""
        store = self.outbox.store
        if self._batched:
            with store.batch(now=self.outbox.store_now()) as batch:
                yield batch
        else:
            with store.rounds(concurrency=self.concurrency) as deliveries:
                yield deliveries

    def _deliver_all(self, deliveries: Deliveries, batch: ClaimedBatch) -> None:
        """Deliver the batch's events in claim order; stop early when asked (the rest is
        released by the caller)."""
        bus = self.outbox.bus
        while not self._stop.is_set() and (run := batch.take(bus.names_for)) is not None:
            self._deliver_event(deliveries, batch, run)

    def _deliver_event(self, deliveries: Deliveries, batch: ClaimedBatch, run: EventRun) -> None:
        outbox = self.outbox
        handling.unrouted(outbox, run)
        specs = outbox.bus.by_name_for(run.claim.event.topic)
        for name in run.handlers:
            # R13: keep the batch's leases alive; never start a handler once ours is gone.
            if not self._keep_lease(deliveries, batch, run):
                break
            spec = specs[name]
            if spec.relay is None:
                delivery = self._deliver(deliveries, run.claim, spec)
            else:
                delivery = self._relay(deliveries, batch, run, spec)
            batch.delivered(run, delivery)
            if delivery.outcome is Outcome.CRASHED:  # the lease was lost under the handler
                handling.lease_lost(outbox, run.claim, name)
                break
        batch.finish(run)

    def _relay(
        self, deliveries: Deliveries, batch: ClaimedBatch, run: EventRun, spec: HandlerSpec
    ) -> Delivery:
        """A relay's delivery of ``run``'s event: on the round's first event for the relay, it
        publishes every one the batch holds for it together, and the confirmed ones are
        recorded together, each fenced by its token, as non-transactional runs (R7:
        ``record_many``; a batch keeps them for its settlement). Each event's delivery is then
        reported in its turn: recorded, lost, or failed with the broker's answer."""
        assert spec.relay is not None
        outbox = self.outbox
        if not batch.was_relayed(spec.name, run.claim):
            claims = batch.relay_claims(spec.name, run, outbox.bus.names_for)
            try:
                answers: object = spec.relay.publish_blocking([c.event for c in claims])
            except Exception as exc:  # a relay's bug: every event fails with it
                answers = [exc] * len(claims)
            confirmed = batch.relayed(
                spec.name, claims, handling.relay_answers(spec, len(claims), answers)
            )
            written = deliveries.record_many(spec.name, confirmed, now=outbox.store_now())
            batch.recorded(spec.name, confirmed, written)
        answer = batch.relay_result(spec.name, run.claim)
        if isinstance(answer, Reject):  # not a broker's answer, but recorded as one
            return self._deliver(
                deliveries, run.claim, handling.relayed(spec, answer, asyncio=False)
            )
        return handling.relay_delivery(outbox, run.claim, spec, answer)

    def _keep_lease(self, deliveries: Deliveries, batch: ClaimedBatch, run: EventRun) -> bool:
        outbox = self.outbox
        if self._prefetcher is not None:
            self._prefetcher.keep()  # the next batch's leases too, while it waits
        check = batch.check_lease(run, outbox.local_clock.now())
        if check is LeaseCheck.EXTEND:
            asked = batch.to_extend()
            kept = deliveries.extend(asked, lease=self.options.lease, now=outbox.store_now())
            for claim in batch.extended(asked, kept, outbox.local_clock.now()):
                handling.lease_lost(outbox, claim, None)
            check = batch.check_lease(run, outbox.local_clock.now())
        elif check is LeaseCheck.LOST:
            batch.lose(run)
            handling.lease_lost(outbox, run.claim, None)
        return check is not LeaseCheck.LOST

    def _write(self, deliveries: Deliveries, batch: ClaimedBatch) -> None:
        """The round's settlements in one ``settle_many`` (R8, each fenced by its token); in a
        batch, its last write (``settle_last``: the block ends right after it)."""
        items = batch.to_write()
        if not items:
            return
        now = self.outbox.store_now()
        if self._batched:
            results = cast(BatchTransaction, deliveries).settle_last(items, now=now)
        else:
            results = deliveries.settle_many(items, now=now)
        for claim in batch.wrote(items, results):
            handling.lease_lost(self.outbox, claim, None)
        if not self._batched:
            handling.announce(self.outbox, batch.committed())

    def _deliver(self, deliveries: Deliveries, claim: Claim, spec: HandlerSpec) -> Delivery:
        """Run one handler for one claimed event, with its record (R6, R7)."""
        outbox = self.outbox
        ctx, at, began, scope = self._begin_run(claim, spec)
        try:
            if spec.transactional:
                with deliveries.delivery(claim, now=outbox.store_now()) as tx:
                    ctx.bind(tx)
                    _call(spec, claim.event, ctx, scope)
                    tx.record(spec.name, Outcome.SUCCEEDED)
            else:
                _call(spec, claim.event, ctx, scope)
                # The record's transaction opens after the handler ran: stamp it (and the
                # follow-ups' delays) with that instant, as a database clock would.
                with deliveries.delivery(claim, now=outbox.store_now()) as tx:
                    if ctx.buffer:
                        tx.enqueue(ctx.buffer)
                    tx.record(spec.name, Outcome.SUCCEEDED)
        except Reject as rejection:
            reason = handling.reason_of(rejection)
            try:
                with deliveries.delivery(claim, now=outbox.store_now()) as tx:
                    tx.record(spec.name, Outcome.REJECTED, reason=reason)
            except LeaseLostError:
                return handling.lost(claim, spec, at)
            return handling.rejected(outbox, claim, spec, at, reason, began)
        except LeaseLostError:
            return handling.lost(claim, spec, at)
        except (handling.HandlerError, HandlerCrashed) as failure:
            return handling.failed(outbox, claim, spec, at, failure, began)
        return handling.succeeded(outbox, claim, spec, at, began)

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
        self.outbox.add_waiter(self.waiter)
        try:
            with self._prefetching() as prefetcher:
                self._run_forever(prefetcher, interval)
        finally:
            self.outbox.remove_waiter(self.waiter)
            if self._owned is not None:
                self._owned.close()

    def _run_forever(self, prefetcher: _Prefetcher | None, interval: float) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                report = self._round(prefetcher)
            except SchemaError:
                raise
            except StoreError as exc:
                if prefetcher is not None:
                    prefetcher.release()  # its leases would run out while the outage lasts
                failures += 1
                if failures == 1:
                    log.error("store unavailable, retrying with backoff: %s", exc)
                self.waiter.wait(outage_delay(failures, interval))
                continue
            if failures:
                log.warning("store available again after %d failed poll(s)", failures)
                failures = 0
            self.outbox.prune_if_due()  # retention: at most once a minute, logs its failures
            if len(report.claimed) < self.options.batch_size and not self._stop.is_set():
                self.waiter.wait(interval)

    def run_until_idle(
        self,
        *,
        on_idle: Callable[[], bool] | None = None,
        on_round: Callable[[PollReport], None] | None = None,
    ) -> list[PollReport]:
        """Poll until a poll claims nothing (or :meth:`stop` is called), without waiting.

        The one drain loop: ``outboxkit run --until-idle`` uses it as it is; the test kit's
        drain passes ``on_idle`` to move its virtual clock to the next due time.

        Args:
            on_idle: called when a poll claimed nothing; True polls again (something may have
                become due meanwhile), False (or no callable) ends the drain.
            on_round: called with each poll's report that claimed something.

        Returns:
            The reports of the polls that claimed something, in order.
        """
        reports: list[PollReport] = []
        with self._prefetching() as prefetcher:
            while not self._stop.is_set():
                report = self._round(prefetcher)
                if report.claimed:
                    reports.append(report)
                    if on_round is not None:
                        on_round(report)
                    continue
                if on_idle is None or not on_idle():
                    break
        return reports


class _Prefetcher:
    """The next batch's claim, made on a worker thread while the poller delivers the batch in
    hand (``prefetch``). One at a time; ``take`` waits for it and hands over what it claimed
    (raising what the claim raised), ``release`` hands its claims back to the store, as a
    stopping poller does with its unstarted ones."""

    def __init__(self, poller: Poller) -> None:
        self._poller = poller
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="outboxkit-prefetch")
        self._pending: Future[tuple[datetime, list[Claim]]] | None = None
        self._kept: tuple[datetime, list[Claim]] | None = None  # what ``keep`` extended

    def start(self) -> None:
        if self._pending is None:
            self._pending = self._executor.submit(self._poller._claim)

    def keep(self) -> None:
        """R13 for the claims waiting for their turn: once less than half of their lease is
        left, extend them (a claim another poller took meanwhile is dropped, its lease lost),
        so that they are still held when the batch in hand is done.

        Raises:
            StoreError: the extension failed (the round fails as for any store error).
        """
        pending = self._pending
        if pending is None or not pending.done() or pending.exception() is not None:
            return
        poller = self._poller
        outbox, lease = poller.outbox, poller.options.lease
        claimed_at, claims = self._kept or pending.result()
        now = outbox.local_clock.now()
        if not claims or check_lease(deadline=claimed_at + lease, now=now, lease=lease) is not (
            LeaseCheck.EXTEND
        ):
            return
        kept = outbox.store.extend(claims, lease=lease, now=outbox.store_now())
        for claim in lost_of(claims, kept):
            handling.lease_lost(outbox, claim, None)
        self._kept = (now, kept)

    def take(self) -> tuple[datetime, list[Claim]] | None:
        pending, self._pending = self._pending, None
        kept, self._kept = self._kept, None
        if pending is None:
            return None
        result = pending.result()
        return kept or result

    def release(self) -> None:
        """Hand back what the pending claim took; its own failure, or one of the release, is
        logged (the leases recover the events)."""
        try:
            taken = self.take()
            if taken and taken[1]:
                outbox = self._poller.outbox
                released = outbox.store.release(taken[1], now=outbox.store_now())
                log.info("released %d prefetched claim(s)", released)
        except Exception as exc:
            log.warning("prefetched claims not released (their leases recover them): %s", exc)

    def close(self) -> None:
        self.release()
        self._executor.shutdown(wait=True)


def _call(
    spec: HandlerSpec,
    event: Event,
    ctx: handling.Context,
    around: AbstractContextManager[object],
) -> None:
    """Run the handler inside ``around`` (``handling.handler_scope``: a tracing span, which
    sees the handler's own exception)."""
    try:
        if around is handling.NO_SCOPE:
            result = spec.fn(event, ctx)
        else:
            with around:
                result = spec.fn(event, ctx)
        if ctx.scope is not None and not (result is not None and inspect.isawaitable(result)):
            ctx.scope.finish()  # the session's pending writes, before the record
    except Reject:
        raise
    except Exception as exc:
        raise handling.HandlerError(exc) from exc
    finally:
        if ctx.scope is not None:
            ctx.scope.close()
    if result is not None and inspect.isawaitable(result):
        raise handling.awaitable_returned(spec, result)
