"""The poller: claim -> deliver -> settle, once (``run_once``) or in a loop.

This file is the asyncio poller, ``AsyncPoller``, and the one source of the blocking poller:
``outboxkit/poller.py`` (``Poller``) is generated from it by ``tools/async_to_sync.py`` (the
``async`` and ``await`` dropped, the asyncio names swapped for the blocking ones, and each
``if ASYNC:`` for its ``else:``). Both are a thin shell over the pure core:
``outboxkit.core.batch.ClaimedBatch`` says what comes next, ``outboxkit.core.machine`` decides
every outcome, ``Reporter`` reports them; here only the waiting, for the store and for the
handlers. The same code path runs in production and inside ``outbox_drain``.

Where the two pollers differ, they differ because one blocks and the other does not, and each
``if ASYNC:`` says so where it stands:

- ``concurrency``: the asyncio poller delivers that many events of a claimed batch at once, each
  on its own connection; the blocking poller runs its handlers one at a time, and gives the
  number to the store's per-event round (``Store.rounds``: on PostgreSQL, the connections a
  round's records are committed on at once, without waiting for each);
- a transactional handler's delivery transaction: the asyncio poller makes it ready before the
  handler runs (``await tx.open()``: a property cannot await; PostgreSQL's still opens when the
  handler first takes ``ctx.connection``), the blocking one opens it then (a handler that never
  does costs no transaction of its own);
- handlers: the asyncio poller awaits ``async def`` handlers and runs blocking ones in a worker
  thread (``call_async``); the blocking poller refuses ``async def`` handlers (``call``);
- a relay publishes on the poller's loop (``publish``), or on the relay's own loop for the
  blocking poller (``publish_blocking``); the next batch's claim (``prefetch``) runs in a task,
  or on a worker thread; retention runs in a worker thread, or in the loop's own.

``concurrency`` events are delivered with every rule holding as with one: each event's handlers
in subscription order, a recorded handler never run again, the leases of waiting events kept
alive, the unstarted released on stop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager, nullcontext
from datetime import datetime, timedelta
from typing import Any, cast

from .bus import HandlerSpec
from .calls import (
    MAX_CONCURRENCY,
    call_async,
    check_handlers,
    reason_of,
    relay_answers,
    relayed_async,
)
from .core.batch import ClaimedBatch, EventRun
from .core.machine import LeaseCheck, check_lease, lost_of, outage_delay, prefetches
from .core.model import Claim, Delivery, Outcome, PollReport
from .core.options import PollerOptions
from .errors import (
    ConfigurationError,
    HandlerCrashed,
    LeaseLostError,
    Reject,
    SchemaError,
    StoreError,
)
from .reports import HandlerError
from .runtime import Runtime
from .shell import PollerBase
from .store import AsyncBatchTransaction, AsyncDeliveries, AsyncStore
from .waiter import AsyncClosingWaiter, AsyncWaiter, LoopWaiter

__all__ = ["MAX_CONCURRENCY", "AsyncPoller"]

ASYNC = True
"""This file is the asyncio side (``tools/async_to_sync.py`` keeps the ``else:`` of every
``if ASYNC:`` for the blocking side)."""

log = logging.getLogger("outboxkit")

Taken = tuple[datetime, list[Claim]]
"""A claim made: the local-clock instant just before it (its leases count from there), and its
claims, in claim order."""


class AsyncPoller(PollerBase):
    """Claims due events and delivers them. Make one with ``Outbox.async_poller(**options)``.

    ``stop()`` may be called from any thread or a signal handler. What ``concurrency`` means
    to each poller: see ``outboxkit/aio.py``'s module docstring.

    Raises:
        ConfigurationError: a handler this poller cannot run on the bus, or a store that
            cannot serve it (the asyncio poller needs an asyncio side); ``concurrency`` not
            from 1 to ``MAX_CONCURRENCY``, or above 1 with ``transaction="per_batch"`` (a batch
            is one transaction on one connection); or ``per_batch`` on a store without
            batches.
    """

    def __init__(
        self,
        runtime: Runtime,
        options: PollerOptions,
        *,
        concurrency: int = 1,
        waiter: AsyncWaiter | None = None,
    ) -> None:
        super().__init__(runtime, options, concurrency)
        if ASYNC:
            if not runtime.store.capabilities.asyncio:
                raise ConfigurationError(
                    f"the asyncio poller needs a store with an asyncio side; {runtime.store!r} "
                    "has none (capabilities.asyncio is false): use outbox.poller()"
                )
            check_handlers(runtime.bus.specs(), asyncio=True)
            self.store: AsyncStore = runtime.store.async_store()
            # One lease extension at a time for the workers of a batch.
            self._extending: asyncio.Lock | nullcontext[None] = asyncio.Lock()
            # Set (and replaced) whenever a relay's publish ends: the workers whose events it
            # held wait on it (``_relay``).
            self._relay_answered = asyncio.Event()
        else:
            check_handlers(runtime.bus.specs(), asyncio=False)
            self.store = runtime.store
            self._extending = nullcontext()  # one worker: nothing to wait for
        # Without a waiter given, the store may offer one that also wakes on commits in other
        # processes; this poller then closes it when run_forever ends.
        self._owned: AsyncClosingWaiter | None = None
        if waiter is None:
            self._owned = self.store.make_waiter()
        self.waiter: AsyncWaiter = waiter or self._owned or LoopWaiter()
        self._prefetcher: AsyncPrefetcher | None = None  # the loop's, while it runs

    if ASYNC:

        def _described(self) -> str:
            return f", concurrency={self.concurrency}"

    # -- one round ------------------------------------------------------------------------------

    async def run_once(self) -> PollReport:
        """Claim one batch, deliver every event in claim order, settle each (R3-R13).

        Returns:
            What happened, event by event and handler by handler.

        Raises:
            StoreError: the store failed (a database failure is never blamed on a handler).
            BaseException: re-raised from a handler (KeyboardInterrupt, SystemExit) after
                releasing the events not yet started; the events in hand recover by their lease.
        """
        claimed_at, claims = await self._claim()
        return await self.process(claims, claimed_at=claimed_at)

    async def _claim(self) -> Taken:
        """One claim (R3), and the local-clock instant just before it."""
        runtime = self.runtime
        claimed_at = runtime.local_clock.now()
        claims = await self.store.claim(
            batch_size=self.options.batch_size,
            lease=self.options.lease,
            now=runtime.store_now(),
            dead_key=runtime.dead_key,
        )
        return claimed_at, claims

    async def _round(self, prefetcher: AsyncPrefetcher | None) -> PollReport:
        """One round of the loops: ``run_once``, or with ``prefetch`` the claim made while the
        last batch was delivered, the next one made while this one is (``prefetches``), its
        leases kept alive meanwhile (``_keep_lease``)."""
        self._prefetcher = prefetcher
        prefetched = None if prefetcher is None else await prefetcher.take()
        if prefetched is not None and prefetched[1]:
            claimed_at, claims = prefetched
        else:  # none made, or an empty one: the last batch's follow-ups may be due since
            claimed_at, claims = await self._claim()
        if prefetcher is not None and prefetches(
            enabled=not self._stop.is_set(), claimed=len(claims), batch_size=self.options.batch_size
        ):
            prefetcher.start()
        return await self.process(claims, claimed_at=claimed_at)

    @asynccontextmanager
    async def _prefetching(self) -> AsyncIterator[AsyncPrefetcher | None]:
        """The loops' prefetcher (None without ``prefetch``); what it holds when the loop ends
        is released."""
        if not self._prefetch:
            yield None
            return
        prefetcher = AsyncPrefetcher(self._claim, self.store, self.runtime, self.options.lease)
        try:
            yield prefetcher
        finally:
            await prefetcher.close()

    async def process(self, claims: Sequence[Claim], *, claimed_at: datetime) -> PollReport:
        """Deliver and settle claims this poller just made (``run_once`` without the claim).

        Args:
            claims: fresh claims, in claim order.
            claimed_at: the runtime's ``local_clock`` instant just before the claim (lease
                deadlines count from it).
        """
        batch = self._claimed(claims, claimed_at)
        if not claims:
            return batch.report
        runtime = self.runtime
        try:
            async with self._deliveries(claims) as deliveries:
                try:
                    await self._deliver_all(deliveries, batch)
                finally:
                    # Per event, what was settled is written even when a handler raised a
                    # BaseException; in a batch, only if the batch goes on to commit.
                    if not self._batched:
                        await self._write(deliveries, batch)
                if self._batched:
                    await self._write(deliveries, batch)
            runtime.reporter.announce(batch.committed())
        finally:
            # Stopping, a handler raised BaseException, or work a rollback undid: hand back
            # those claims (after a batch has ended: its transaction may hold their rows).
            unstarted = batch.unstarted()
            if unstarted:
                released = await self.store.release(unstarted, now=runtime.store_now())
                stopping = "poller stopping: " if self._stop.is_set() else ""
                log.info("%sreleased %d unstarted claim(s)", stopping, released)
        return batch.final_report()

    @asynccontextmanager
    async def _deliveries(self, claims: Sequence[Claim]) -> AsyncIterator[AsyncDeliveries]:
        """Where the round's deliveries of ``claims`` go: a batch transaction, told its claims
        (``claimed``: a batch written before it had none), or the store's per-event round
        (``Store.rounds``: the store itself, unless it has a faster way)."""
        store = self.store
        if self._batched:
            async with store.batch(now=self.runtime.store_now()) as batch:
                claimed = getattr(batch, "claimed", None)
                if claimed is not None:
                    await claimed(claims)
                yield batch
        else:
            async with store.rounds(concurrency=self.concurrency) as deliveries:
                yield deliveries

    async def _deliver_all(self, deliveries: AsyncDeliveries, batch: ClaimedBatch) -> None:
        """Deliver the batch's events, each taken in claim order; stop taking new ones when
        asked (the rest is released by the caller)."""
        names_for = self.runtime.bus.names_for

        async def worker() -> None:
            while not self._stop.is_set() and (run := batch.take(names_for)) is not None:
                await self._deliver_event(deliveries, batch, run)

        if ASYNC:
            workers = min(self.concurrency, len(batch))
            if workers > 1:  # ``concurrency`` events at once
                try:
                    async with asyncio.TaskGroup() as group:
                        for _ in range(workers):
                            group.create_task(worker())
                except BaseExceptionGroup as failures:
                    # The first failure is the one to report (a store error, a
                    # KeyboardInterrupt): the other workers were cancelled in the middle of
                    # their events, which recover by their leases, as after a crash.
                    raise failures.exceptions[0] from None
                return
        await worker()

    async def _deliver_event(
        self, deliveries: AsyncDeliveries, batch: ClaimedBatch, run: EventRun
    ) -> None:
        reporter = self.runtime.reporter
        reporter.unrouted(run)
        specs = self.runtime.bus.by_name_for(run.claim.event.topic)
        for name in run.handlers:
            # R13: keep the batch's leases alive; never start a handler once ours is gone.
            if not await self._keep_lease(deliveries, batch, run):
                break
            spec = specs[name]
            if spec.relay is None:
                delivery = await self._deliver(deliveries, run.claim, spec)
            else:
                delivery = await self._relay(deliveries, batch, run, spec)
            batch.delivered(run, delivery)
            if delivery.outcome is Outcome.LEASE_LOST:  # lost under the handler
                reporter.lease_lost(run.claim, name)
                break
        batch.finish(run)

    async def _relay(
        self, deliveries: AsyncDeliveries, batch: ClaimedBatch, run: EventRun, spec: HandlerSpec
    ) -> Delivery:
        """A relay's delivery of ``run``'s event: on the round's first event for the relay, it
        publishes every one the batch holds for it together, and the confirmed ones are
        recorded together, each fenced by its token, as non-transactional runs (R7:
        ``record_many``; a batch keeps them for its settlement). Each event's delivery is then
        reported in its turn: recorded, lost, or failed with the broker's answer."""
        assert spec.relay is not None
        runtime = self.runtime
        if ASYNC:
            # With ``concurrency``, the batch's events for a relay are still published
            # together, by the worker that reaches the first: an event handed to the relay by
            # another worker waits for that worker's answer.
            while batch.is_handed(spec.name, run.claim):
                await self._relay_answered.wait()
        if not batch.was_relayed(spec.name, run.claim):
            claims = batch.relay_claims(spec.name, run, runtime.bus.names_for)
            try:
                try:
                    answers: object = await spec.relay.publish([c.event for c in claims])
                except Exception as exc:  # a relay's bug: every event fails with it
                    answers = [exc] * len(claims)
                checked = relay_answers(spec, len(claims), answers)
                confirmed = batch.relayed(spec.name, claims, checked)
                written = await deliveries.record_many(
                    spec.name, confirmed, now=runtime.store_now()
                )
                batch.recorded(spec.name, confirmed, written)
            finally:
                batch.unhanded(spec.name, claims)  # answered, or given up: no one waits on
                if ASYNC:
                    self._relay_answered.set()
                    self._relay_answered = asyncio.Event()
        answer = batch.relay_result(spec.name, run.claim)
        if isinstance(answer, Reject):  # not a broker's answer, but recorded as one
            return await self._deliver(deliveries, run.claim, relayed_async(spec, answer))
        return runtime.reporter.relayed(run.claim, spec, answer)

    async def _keep_lease(
        self, deliveries: AsyncDeliveries, batch: ClaimedBatch, run: EventRun
    ) -> bool:
        """R13 before one of ``run``'s handlers starts: extend the batch's leases (and the
        prefetched batch's) once low; False when ``run``'s lease is gone."""
        runtime = self.runtime
        if self._prefetcher is not None:
            async with self._extending:
                await self._prefetcher.keep()  # the next batch's leases too, while it waits
        check = batch.check_lease(run, runtime.local_clock.now())
        if check is LeaseCheck.EXTEND:
            async with self._extending:  # one extension for every worker that found it low
                check = batch.check_lease(run, runtime.local_clock.now())
                if check is LeaseCheck.EXTEND:
                    asked = batch.to_extend()
                    kept = await deliveries.extend(
                        asked, lease=self.options.lease, now=runtime.store_now()
                    )
                    for claim in batch.extended(asked, kept, runtime.local_clock.now()):
                        runtime.reporter.lease_lost(claim, None)
                    check = batch.check_lease(run, runtime.local_clock.now())
        if check is LeaseCheck.LOST and not run.lost:
            batch.lose(run)
            runtime.reporter.lease_lost(run.claim, None)
        return check is not LeaseCheck.LOST

    async def _write(self, deliveries: AsyncDeliveries, batch: ClaimedBatch) -> None:
        """The round's settlements in one ``settle_many`` (R8, each fenced by its token); in a
        batch, its last write (``settle_last``: the block ends right after it)."""
        items = batch.to_write()
        if not items:
            return
        runtime = self.runtime
        now = runtime.store_now()
        if self._batched:  # ``deliveries`` is the batch (``_deliveries``)
            results = await cast(AsyncBatchTransaction, deliveries).settle_last(items, now=now)
        else:
            results = await deliveries.settle_many(items, now=now)
        for claim in batch.wrote(items, results):
            runtime.reporter.lease_lost(claim, None)
        if not self._batched:
            runtime.reporter.announce(batch.committed())

    async def _deliver(
        self, deliveries: AsyncDeliveries, claim: Claim, spec: HandlerSpec
    ) -> Delivery:
        """Run one handler for one claimed event, with its record (R6, R7); its follow-ups are
        written with the record, in the same transaction."""
        reporter = self.runtime.reporter
        store_now = self.runtime.store_now
        ctx, at, began, scope = self._begin_run(claim, spec)
        try:
            if spec.transactional:
                async with deliveries.delivery(claim, now=store_now()) as tx:
                    if ASYNC:
                        await tx.open()  # ready before the handler: a property cannot await
                    ctx.bind(tx)
                    await call_async(spec, claim.event, ctx, scope)
                    if ctx.buffer:
                        await tx.enqueue(ctx.buffer)
                    await tx.record(spec.name, Outcome.SUCCEEDED)
            else:
                await call_async(spec, claim.event, ctx, scope)
                # The record's transaction opens after the handler ran: stamp it (and the
                # follow-ups' delays) with that instant, as a database clock would.
                async with deliveries.delivery(claim, now=store_now()) as tx:
                    if ctx.buffer:
                        await tx.enqueue(ctx.buffer)
                    await tx.record(spec.name, Outcome.SUCCEEDED)
        except Reject as rejection:
            reason = reason_of(rejection)
            try:
                async with deliveries.delivery(claim, now=store_now()) as tx:
                    await tx.record(spec.name, Outcome.REJECTED, reason=reason)
            except LeaseLostError:
                return reporter.lost(claim, spec, at)
            return reporter.rejected(claim, spec, at, reason, began)
        except LeaseLostError:
            return reporter.lost(claim, spec, at)
        except (HandlerError, HandlerCrashed) as failure:
            return reporter.failed(claim, spec, at, failure, began)
        return reporter.succeeded(claim, spec, at, began)

    # -- the loop ---------------------------------------------------------------------------------

    async def run_forever(self) -> None:
        """Poll until :meth:`stop` is called: at ``interval`` when idle, at once when busy.

        A database outage is logged once, waited out with backoff, and its end logged; the
        loop goes on. A ``SchemaError`` (missing or incompatible schema) is raised at once.
        Published events older than the outbox's ``retain_published`` are pruned at most once
        a minute (``Outbox.prune_if_due``).

        Raises:
            SchemaError: the store's schema is missing or incompatible.
        """
        interval = self.options.interval.total_seconds()
        self.runtime.add_waiter(self.waiter)
        try:
            async with self._prefetching() as prefetcher:
                await self._run_forever(prefetcher, interval)
        finally:
            self.runtime.remove_waiter(self.waiter)
            if self._owned is not None:
                await self._owned.close()

    async def _run_forever(self, prefetcher: AsyncPrefetcher | None, interval: float) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                report = await self._round(prefetcher)
            except SchemaError:
                raise
            except StoreError as exc:
                if prefetcher is not None:
                    await prefetcher.release()  # its leases would run out during the outage
                failures += 1
                if failures == 1:
                    log.error("store unavailable, retrying with backoff: %s", exc)
                await self.waiter.wait(outage_delay(failures, interval))
                continue
            if failures:
                log.warning("store available again after %d failed poll(s)", failures)
                failures = 0
            # Retention: at most once a minute, logs its failures (a blocking store call: in a
            # worker thread, off the event loop).
            if ASYNC:
                await asyncio.to_thread(self.runtime.prune_if_due)
            else:
                self.runtime.prune_if_due()
            if len(report.claimed) < self.options.batch_size and not self._stop.is_set():
                await self.waiter.wait(interval)

    async def run_until_idle(
        self,
        *,
        on_idle: Callable[[], bool] | None = None,
        on_round: Callable[[PollReport], None] | None = None,
        after_short_round: Callable[[], bool] | None = None,
    ) -> list[PollReport]:
        """Poll until a poll claims nothing (or :meth:`stop` is called), without waiting.

        The one drain loop: ``outboxkit run --until-idle`` uses it as it is; the test kit's
        drain passes ``on_idle`` to move its virtual clock to the next due time.

        Args:
            on_idle: called when a poll claimed nothing; True polls again (something may have
                become due meanwhile), False (or no callable) ends the drain.
            on_round: called with each poll's report that claimed something.
            after_short_round: called (without ``prefetch``) after a poll that claimed less
                than a batch, in place of the next poll's claim when that would most likely
                find nothing: True polls again, False ends the drain. The test kit's drain
                reads what is left once instead of claiming nothing, then reading it.

        Returns:
            The reports of the polls that claimed something, in order.
        """
        reports: list[PollReport] = []
        async with self._prefetching() as prefetcher:
            while not self._stop.is_set():
                report = await self._round(prefetcher)
                if report.claimed:
                    reports.append(report)
                    if on_round is not None:
                        on_round(report)
                    if (
                        after_short_round is not None
                        and prefetcher is None
                        and len(report.claimed) < self.options.batch_size
                        and not after_short_round()
                    ):
                        break
                    continue
                if on_idle is None or not on_idle():
                    break
        return reports


class AsyncPrefetcher:
    """The next batch's claim, made while the poller delivers the batch in hand (``prefetch``;
    in a task of its own, or on a worker thread). One at a time: ``take`` waits for it and
    hands over what it claimed (raising what the claim raised); ``keep`` extends its leases
    while it waits; ``release`` hands its claims back to the store, as a stopping poller does
    with its unstarted ones.

    Args:
        claim: makes one claim (the poller's).
        store: the store the claims are extended on and released to.
        runtime: the poller's runtime (its clocks and reporter).
        lease: the poller's lease.
    """

    def __init__(
        self,
        claim: Callable[[], Any],
        store: AsyncStore,
        runtime: Runtime,
        lease: timedelta,
    ) -> None:
        self._claim = claim
        self._store = store
        self._runtime = runtime
        self._lease = lease
        self._kept: Taken | None = None  # what ``keep`` extended
        if ASYNC:
            self._pending: asyncio.Future[Taken] | None = None
        else:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="outboxkit-prefetch")
            self._pending: Future[Taken] | None = None

    def start(self) -> None:
        if self._pending is None:
            if ASYNC:
                self._pending = asyncio.ensure_future(self._claim())
            else:
                self._pending = self._executor.submit(self._claim)

    async def keep(self) -> None:
        """R13 for the claims waiting for their turn: once less than half of their lease is
        left, extend them (a claim another poller took meanwhile is dropped, its lease lost),
        so that they are still held when the batch in hand is done.

        Raises:
            StoreError: the extension failed (the round fails as for any store error).
        """
        pending = self._pending
        if pending is None or not pending.done() or pending.exception() is not None:
            return
        runtime, lease = self._runtime, self._lease
        claimed_at, claims = self._kept or pending.result()
        now = runtime.local_clock.now()
        low = check_lease(deadline=claimed_at + lease, now=now, lease=lease)
        if not claims or low is not LeaseCheck.EXTEND:
            return
        kept = await self._store.extend(claims, lease=lease, now=runtime.store_now())
        for claim in lost_of(claims, kept):
            runtime.reporter.lease_lost(claim, None)
        self._kept = (now, kept)

    async def take(self) -> Taken | None:
        pending, self._pending = self._pending, None
        kept, self._kept = self._kept, None
        if pending is None:
            return None
        if ASYNC:
            result = await pending
        else:
            result = pending.result()
        return kept or result

    async def release(self) -> None:
        """Hand back what the pending claim took; its own failure, or one of the release, is
        logged (the leases recover the events)."""
        try:
            taken = await self.take()
            if taken and taken[1]:
                runtime = self._runtime
                released = await self._store.release(taken[1], now=runtime.store_now())
                log.info("released %d prefetched claim(s)", released)
        except Exception as exc:
            log.warning("prefetched claims not released (their leases recover them): %s", exc)

    async def close(self) -> None:
        await self.release()
        if not ASYNC:
            self._executor.shutdown(wait=True)
