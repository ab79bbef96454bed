"""The asyncio poller: claim -> deliver -> settle, once (``run_once``) or in a loop.

The same thin shell as ``outboxkit.poller``, name for name, over the same core
(``ClaimedBatch`` says what comes next, ``core.machine`` decides, ``handling`` reports); only the
waiting differs: the store's asyncio side (``Store.async_store()``) is awaited, ``async def``
handlers are awaited, and blocking non-transactional handlers run in a worker thread.

``concurrency`` events of a claimed batch are delivered at once, each on its own connection:
every rule holds as with one (each event's handlers in subscription order, a recorded handler
never run again, the leases of waiting events kept alive, the unstarted released on stop).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractContextManager, asynccontextmanager
from datetime import datetime
from typing import TYPE_CHECKING, cast

from . import handling
from .bus import HandlerSpec
from .core.batch import ClaimedBatch, EventRun
from .core.machine import LeaseCheck, check_lease, lost_of, outage_delay, prefetches
from .core.model import Claim, Delivery, Event, Outcome, PollReport
from .core.options import PollerOptions
from .errors import (
    ConfigurationError,
    HandlerCrashed,
    LeaseLostError,
    Reject,
    SchemaError,
    StoreError,
)
from .store import AsyncBatchTransaction, AsyncDeliveries, AsyncStore
from .waiter import AsyncClosingWaiter, AsyncWaiter, LoopWaiter

if TYPE_CHECKING:
    from .outbox import Outbox

__all__ = ["MAX_CONCURRENCY", "AsyncPoller"]

log = logging.getLogger("outboxkit")

MAX_CONCURRENCY = handling.MAX_CONCURRENCY
"""The most events one asyncio poller delivers at once (each holds a connection)."""


class AsyncPoller(handling.Shell):
    """Claims due events and delivers them on asyncio. Make one with
    ``Outbox.async_poller(concurrency=1, **options)``.

    ``stop()`` may be called from any thread or a signal handler.

    Raises:
        ConfigurationError: the store has no asyncio side; a blocking transactional handler on
            the bus; ``concurrency`` not from 1 to ``MAX_CONCURRENCY``, or above 1 with
            ``transaction="per_batch"`` (a batch is one transaction on one connection); or
            ``per_batch`` on a store without batches.
    """

    def __init__(
        self,
        outbox: Outbox,
        options: PollerOptions,
        *,
        concurrency: int = 1,
        waiter: AsyncWaiter | None,
    ) -> None:
        super().__init__(outbox, options, concurrency)
        if not outbox.store.capabilities.asyncio:
            raise ConfigurationError(
                f"the asyncio poller needs a store with an asyncio side; {outbox.store!r} has "
                "none (capabilities.asyncio is false): use outbox.poller()"
            )
        handling.check_handlers(outbox.bus.specs(), asyncio=True)
        self.store: AsyncStore = outbox.store.async_store()
        self._owned: AsyncClosingWaiter | None = None
        if waiter is None:
            self._owned = self.store.make_waiter()
        self.waiter: AsyncWaiter = waiter or self._owned or LoopWaiter()
        # Set (and replaced) whenever a relay's publish ends: the workers whose events it held
        # wait on it (``_relay``).
        self._relay_answered = asyncio.Event()
        self._prefetcher: _AsyncPrefetcher | None = None  # the loop's, while it runs

    def _described(self) -> str:
        return f", concurrency={self.concurrency}"

    # -- one round ------------------------------------------------------------------------------

    async def run_once(self) -> PollReport:
        """Claim one batch, deliver its events (``concurrency`` at once), settle each (R3-R13).

        Returns:
            What happened, event by event and handler by handler.

        Raises:
            StoreError: the store failed (a database failure is never blamed on a handler).
            BaseException: re-raised from a handler (KeyboardInterrupt, SystemExit) after
                releasing the events not yet started; the events in hand recover by their lease.
        """
        claimed_at, claims = await self._claim()
        return await self.process(claims, claimed_at=claimed_at)

    async def _claim(self) -> tuple[datetime, list[Claim]]:
        """``Poller._claim``: one claim and the local-clock instant just before it."""
        outbox = self.outbox
        claimed_at = outbox.local_clock.now()
        claims = await self.store.claim(
            batch_size=self.options.batch_size,
            lease=self.options.lease,
            now=outbox.store_now(),
            dead_key=outbox.dead_key,
        )
        return claimed_at, claims

    async def _round(self, prefetcher: _AsyncPrefetcher | None) -> PollReport:
        """``Poller._round``: with ``prefetch``, the next claim runs in a task of its own while
        this batch is delivered."""
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
    async def _prefetching(self) -> AsyncIterator[_AsyncPrefetcher | None]:
        if not self._prefetch:
            yield None
            return
        prefetcher = _AsyncPrefetcher(self)
        try:
            yield prefetcher
        finally:
            await prefetcher.release()

    async def process(self, claims: Sequence[Claim], *, claimed_at: datetime) -> PollReport:
        """Deliver and settle claims this poller just made (``run_once`` without the claim)."""
        batch = self._claimed(claims, claimed_at)
        if not claims:
            return batch.report
        outbox = self.outbox
        try:
            async with self._deliveries() as deliveries:
                try:
                    await self._deliver_all(deliveries, batch)
                finally:
                    if not self._batched:
                        await self._write(deliveries, batch)
                if self._batched:
                    await self._write(deliveries, batch)
            handling.announce(outbox, batch.committed())
        finally:
            unstarted = batch.unstarted()
            if unstarted:
                released = await self.store.release(unstarted, now=outbox.store_now())
                log.info("poller stopping: released %d unstarted claim(s)", released)
        return batch.final_report()

    @asynccontextmanager
    async def _deliveries(self) -> AsyncIterator[AsyncDeliveries]:
        if self._batched:
            async with self.store.batch(now=self.outbox.store_now()) as batch:
                yield batch
        else:
            async with self.store.rounds(concurrency=self.concurrency) as deliveries:
                yield deliveries

    async def _deliver_all(self, deliveries: AsyncDeliveries, batch: ClaimedBatch) -> None:
        """Deliver the batch's events, ``concurrency`` at once, each taken in claim order; stop
        taking new ones when asked (the rest is released by the caller)."""
        bus = self.outbox.bus
        extending = asyncio.Lock()

        async def worker() -> None:
            while not self._stop.is_set() and (run := batch.take(bus.names_for)) is not None:
                await self._deliver_event(deliveries, batch, run, extending)

        workers = min(self.concurrency, len(batch))
        if workers <= 1:
            await worker()
            return
        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(workers):
                    group.create_task(worker())
        except BaseExceptionGroup as failures:
            # The first failure is the one to report (a store error, a KeyboardInterrupt): the
            # other workers were cancelled in the middle of their events, which recover by
            # their leases, as after a crash.
            raise failures.exceptions[0] from None

    async def _deliver_event(
        self,
        deliveries: AsyncDeliveries,
        batch: ClaimedBatch,
        run: EventRun,
        extending: asyncio.Lock,
    ) -> None:
        outbox = self.outbox
        handling.unrouted(outbox, run)
        specs = outbox.bus.by_name_for(run.claim.event.topic)
        for name in run.handlers:
            if not await self._keep_lease(deliveries, batch, run, extending):
                break
            spec = specs[name]
            if spec.relay is None:
                delivery = await self._deliver(deliveries, run.claim, spec)
            else:
                delivery = await self._relay(deliveries, batch, run, spec)
            batch.delivered(run, delivery)
            if delivery.outcome is Outcome.CRASHED:
                handling.lease_lost(outbox, run.claim, name)
                break
        batch.finish(run)

    async def _relay(
        self, deliveries: AsyncDeliveries, batch: ClaimedBatch, run: EventRun, spec: HandlerSpec
    ) -> Delivery:
        """``Poller._relay``, awaiting ``Relay.publish``. With ``concurrency``, the batch's
        events for a relay are still published together, by the worker that reaches the first
        (an event handed to the relay by another worker waits for that worker's answer)."""
        assert spec.relay is not None
        outbox = self.outbox
        while batch.is_handed(spec.name, run.claim):  # another worker is publishing it
            await self._relay_answered.wait()
        if not batch.was_relayed(spec.name, run.claim):
            claims = batch.relay_claims(spec.name, run, outbox.bus.names_for)
            try:
                try:
                    answers: object = await spec.relay.publish([c.event for c in claims])
                except Exception as exc:  # a relay's bug: every event fails with it
                    answers = [exc] * len(claims)
                checked = handling.relay_answers(spec, len(claims), answers)
                confirmed = batch.relayed(spec.name, claims, checked)
                written = await deliveries.record_many(spec.name, confirmed, now=outbox.store_now())
                batch.recorded(spec.name, confirmed, written)
            finally:
                batch.unhanded(spec.name, claims)  # answered, or given up: no one waits on
                self._relay_answered.set()
                self._relay_answered = asyncio.Event()
        answer = batch.relay_result(spec.name, run.claim)
        if isinstance(answer, Reject):  # not a broker's answer, but recorded as one
            return await self._deliver(
                deliveries, run.claim, handling.relayed(spec, answer, asyncio=True)
            )
        return handling.relay_delivery(outbox, run.claim, spec, answer)

    async def _keep_lease(
        self,
        deliveries: AsyncDeliveries,
        batch: ClaimedBatch,
        run: EventRun,
        extending: asyncio.Lock,
    ) -> bool:
        outbox = self.outbox
        if self._prefetcher is not None:
            async with extending:
                await self._prefetcher.keep()  # the next batch's leases too, while it waits
        check = batch.check_lease(run, outbox.local_clock.now())
        if check is LeaseCheck.EXTEND:
            async with extending:  # one extension for every worker that found the lease low
                check = batch.check_lease(run, outbox.local_clock.now())
                if check is LeaseCheck.EXTEND:
                    asked = batch.to_extend()
                    kept = await deliveries.extend(
                        asked, lease=self.options.lease, now=outbox.store_now()
                    )
                    for claim in batch.extended(asked, kept, outbox.local_clock.now()):
                        handling.lease_lost(outbox, claim, None)
                    check = batch.check_lease(run, outbox.local_clock.now())
        if check is LeaseCheck.LOST and not run.lost:
            batch.lose(run)
            handling.lease_lost(outbox, run.claim, None)
        return check is not LeaseCheck.LOST

    async def _write(self, deliveries: AsyncDeliveries, batch: ClaimedBatch) -> None:
        items = batch.to_write()
        if not items:
            return
        now = self.outbox.store_now()
        if self._batched:  # the batch's last write: the block ends right after it
            results = await cast(AsyncBatchTransaction, deliveries).settle_last(items, now=now)
        else:
            results = await deliveries.settle_many(items, now=now)
        for claim in batch.wrote(items, results):
            handling.lease_lost(self.outbox, claim, None)
        if not self._batched:
            handling.announce(self.outbox, batch.committed())

    async def _deliver(
        self, deliveries: AsyncDeliveries, claim: Claim, spec: HandlerSpec
    ) -> Delivery:
        """Run one handler for one claimed event, with its record (R6, R7)."""
        outbox = self.outbox
        ctx, at, began, scope = self._begin_run(claim, spec)
        try:
            if spec.transactional:
                async with deliveries.delivery(claim, now=outbox.store_now()) as tx:
                    await tx.open()  # a property cannot open it when the handler takes it
                    ctx.connection = tx.connection
                    await _call(spec, claim.event, ctx, scope)
                    if ctx.buffer:
                        await tx.enqueue(ctx.buffer)
                    await tx.record(spec.name, Outcome.SUCCEEDED)
            else:
                await _call(spec, claim.event, ctx, scope)
                async with deliveries.delivery(claim, now=outbox.store_now()) as tx:
                    if ctx.buffer:
                        await tx.enqueue(ctx.buffer)
                    await tx.record(spec.name, Outcome.SUCCEEDED)
        except Reject as rejection:
            reason = handling.reason_of(rejection)
            try:
                async with deliveries.delivery(claim, now=outbox.store_now()) as tx:
                    await tx.record(spec.name, Outcome.REJECTED, reason=reason)
            except LeaseLostError:
                return handling.lost(claim, spec, at)
            return handling.rejected(outbox, claim, spec, at, reason, began)
        except LeaseLostError:
            return handling.lost(claim, spec, at)
        except (handling.HandlerError, HandlerCrashed) as failure:
            return handling.failed(outbox, claim, spec, at, failure, began)
        return handling.succeeded(outbox, claim, spec, at, began)

    # -- the loop ---------------------------------------------------------------------------------

    async def run_forever(self) -> None:
        """Poll until :meth:`stop` is called: at ``interval`` when idle, at once when busy.

        As ``Poller.run_forever``: an outage is logged once and waited out with backoff; a
        ``SchemaError`` is raised at once; old published events are pruned once a minute (in a
        worker thread: pruning is a blocking store call).

        Raises:
            SchemaError: the store's schema is missing or incompatible.
        """
        interval = self.options.interval.total_seconds()
        self.outbox.add_waiter(self.waiter)
        try:
            async with self._prefetching() as prefetcher:
                await self._run_forever(prefetcher, interval)
        finally:
            self.outbox.remove_waiter(self.waiter)
            if self._owned is not None:
                await self._owned.close()

    async def _run_forever(self, prefetcher: _AsyncPrefetcher | None, interval: float) -> None:
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
            await asyncio.to_thread(self.outbox.prune_if_due)
            if len(report.claimed) < self.options.batch_size and not self._stop.is_set():
                await self.waiter.wait(interval)

    async def run_until_idle(
        self,
        *,
        on_idle: Callable[[], bool] | None = None,
        on_round: Callable[[PollReport], None] | None = None,
    ) -> list[PollReport]:
        """``Poller.run_until_idle`` on asyncio: poll until a poll claims nothing (or
        :meth:`stop`), without waiting; the test kit's async drain passes ``on_idle``."""
        reports: list[PollReport] = []
        async with self._prefetching() as prefetcher:
            while not self._stop.is_set():
                report = await self._round(prefetcher)
                if report.claimed:
                    reports.append(report)
                    if on_round is not None:
                        on_round(report)
                    continue
                if on_idle is None or not on_idle():
                    break
        return reports


class _AsyncPrefetcher:
    """``poller._Prefetcher`` on asyncio: the next claim in a task of its own."""

    def __init__(self, poller: AsyncPoller) -> None:
        self._poller = poller
        self._pending: asyncio.Task[tuple[datetime, list[Claim]]] | None = None
        self._kept: tuple[datetime, list[Claim]] | None = None  # what ``keep`` extended

    def start(self) -> None:
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._poller._claim())

    async def keep(self) -> None:
        """``poller._Prefetcher.keep``: the waiting claims' leases extended once low."""
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
        kept = await poller.store.extend(claims, lease=lease, now=outbox.store_now())
        for claim in lost_of(claims, kept):
            handling.lease_lost(outbox, claim, None)
        self._kept = (now, kept)

    async def take(self) -> tuple[datetime, list[Claim]] | None:
        pending, self._pending = self._pending, None
        kept, self._kept = self._kept, None
        if pending is None:
            return None
        result = await pending
        return kept or result

    async def release(self) -> None:
        """Hand back what the pending claim took; its own failure, or one of the release, is
        logged (the leases recover the events)."""
        try:
            taken = await self.take()
            if taken and taken[1]:
                poller = self._poller
                released = await poller.store.release(taken[1], now=poller.outbox.store_now())
                log.info("released %d prefetched claim(s)", released)
        except Exception as exc:
            log.warning("prefetched claims not released (their leases recover them): %s", exc)


async def _call(
    spec: HandlerSpec,
    event: Event,
    ctx: handling.Context,
    around: AbstractContextManager[object],
) -> None:
    """Await an ``async def`` handler; run a blocking (non-transactional) one in a worker
    thread, so that it does not hold the event loop. Either runs inside ``around`` (see
    ``handling.handler_scope``), entered and left in this task."""
    try:
        with around:
            if handling.is_coroutine_function(spec.fn):
                result = spec.fn(event, ctx)
                if inspect.isawaitable(result):
                    await result
            else:
                result = await asyncio.to_thread(spec.fn, event, ctx)
                if inspect.isawaitable(result):
                    await result  # a plain function that returns an awaitable: awaited too
        if ctx.scope is not None:
            await _settled(ctx.scope.finish())  # the session's pending writes, first
    except Reject:
        raise
    except Exception as exc:
        raise handling.HandlerError(exc) from exc
    finally:
        if ctx.scope is not None:
            await _settled(ctx.scope.close())


async def _settled(result: object) -> None:
    """Await what a session scope returned, if it is awaitable (an asyncio session's)."""
    if inspect.isawaitable(result):
        await result
