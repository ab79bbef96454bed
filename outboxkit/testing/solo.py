"""``deliver_one``: one handler alone on a new event, through the real delivery path (the
drain's methods for it, a base of ``Drain``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from .. import calls
from ..bus import EventBus, HandlerSpec
from ..clock import FrozenClock
from ..core.model import Claim, PollReport
from ..outbox import Outbox
from .loops import closing, on_a_loop_of_its_own, refuse_running_loop
from .report import DrainReport

if TYPE_CHECKING:
    from ..aio import AsyncPoller

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
