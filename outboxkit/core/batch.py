"""One claimed batch as a poller works through it: the bookkeeping, none of the I/O. PURE.

The poller shells (``outboxkit.poller`` blocking, ``outboxkit.aio`` asyncio) own the I/O: they
claim, run handlers, extend leases, settle and release. A ``ClaimedBatch`` says what comes next
and keeps what happened; every decision in it is the machine's (``plan``, ``check_lease``,
``decide_settlement``), so both shells decide alike by construction.

The life of a batch::

    batch = ClaimedBatch(claims, claimed_at=..., lease=..., max_retries=..., backoff=...)
    while (run := batch.take(subscribed)) is not None:      # claim order (R5)
        for handler in run.handlers:                          # empty for a SettleNow plan
            check = batch.check_lease(run, now)               # HELD, EXTEND or LOST (R13)
            ... batch.extended(asked, kept, now) / batch.lose(run) ...
            batch.delivered(run, delivery)
        batch.finish(run)                                     # the settlement is decided
    results = store.settle_many(batch.to_write())             # one write for the round
    batch.wrote(items, results); batch.committed()            # announced once committed
    store.release(batch.unstarted())                          # a stopped poller's rest

A relay (``EventBus.relay``) is handed the batch's events it matches together: on the first
of them, ``relay_claims`` says which; ``relayed`` keeps the broker's answers and says which
confirms to record, ``recorded`` what became of those records, until each event's turn comes
(``relay_result``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import NamedTuple

from ..errors import BatchRolledBack, LeaseLostError
from .backoff import BackoffPolicy
from .machine import (
    PUBLISH,
    LeaseCheck,
    Plan,
    Retry,
    Run,
    Settlement,
    SettleNow,
    check_lease,
    held_until,
    plan,
)
from .machine import decide_settlement as _decide
from .model import Claim, Delivery, Outcome, PollReport, State
from .text import storable

__all__ = ["ClaimedBatch", "EventRun", "Settled"]


class Settled(NamedTuple):
    """A decided settlement: the claim it fences, what it is, the event's error text."""

    claim: Claim
    settlement: Settlement
    error: str | None


@dataclass(slots=True)
class EventRun:
    """One claimed event, from its claim to its settlement.

    Attributes:
        claim: the claim (its token fences every write).
        plan: the machine's plan for it (``Run`` the handlers, or ``SettleNow``).
        subscribed: the handler names subscribed to its topic, in subscription order.
        outcomes: each handler's outcome so far (the recorded ones from earlier attempts too).
        errors: ``"handler: error"`` for each handler that failed in this attempt.
        lost: the lease is gone: nothing more runs or is written for this event.
    """

    claim: Claim
    plan: Plan
    subscribed: tuple[str, ...]
    outcomes: dict[str, Outcome]
    errors: list[str] = field(default_factory=list)
    lost: bool = False

    @property
    def handlers(self) -> tuple[str, ...]:
        """The handlers to run, in order (none when the plan settles the event at once)."""
        return self.plan.handlers if isinstance(self.plan, Run) else ()


class ClaimedBatch:
    """The bookkeeping of one claimed batch (see the module docstring).

    Args:
        claims: fresh claims, in claim order.
        claimed_at: the poller's local-clock instant just before the claim: every lease
            deadline counts from it, so it is never later than the store's.
        lease, max_retries, backoff: the poller's options.
    """

    def __init__(
        self,
        claims: Sequence[Claim],
        *,
        claimed_at: datetime,
        lease: timedelta,
        max_retries: int,
        backoff: BackoffPolicy,
    ) -> None:
        self.lease = lease
        self.max_retries = max_retries
        self.backoff = backoff
        self.report = PollReport(claimed=[c.event.id for c in claims])
        self._position = {c.event.id: i for i, c in enumerate(claims)}
        self._unstarted: deque[Claim] = deque(claims)
        self._handed_back: list[Claim] = []  # delivered, but their work was undone: released
        self._claimed_until = claimed_at + lease  # every claim's own deadline
        self._deadlines = {c.token: self._claimed_until for c in claims}
        # Every deadline that a later check_lease asks about is at least this one's (the
        # claims' own, then the extension's): before held_until of it, every lease is HELD.
        self._held_until = held_until(deadline=claimed_at + lease, lease=lease)
        self._running: dict[str, EventRun] = {}
        self._to_write: list[Settled] = []  # decided, not written yet
        self._written: list[Settled] = []  # written, not committed yet
        self._relayed: dict[tuple[str, str], Exception | None] = {}  # (relay, token) -> answer
        self._handed: set[tuple[str, str]] = set()  # (relay, token): being published
        self._plans: dict[str, tuple[tuple[str, ...], Plan]] = {}  # token -> (names, plan)

    # -- what comes next ------------------------------------------------------------------------

    def take(self, subscribed: Callable[[str], Sequence[str]]) -> EventRun | None:
        """The next unstarted event in claim order, planned; None when there is none left.

        Args:
            subscribed: the handler names subscribed to a topic, in order.
        """
        if not self._unstarted:
            return None
        claim = self._unstarted.popleft()
        names, planned = self._planned(claim, subscribed)
        run = EventRun(claim=claim, plan=planned, subscribed=names, outcomes=dict(claim.done))
        self._running[claim.token] = run
        return run

    def _planned(
        self, claim: Claim, subscribed: Callable[[str], Sequence[str]]
    ) -> tuple[tuple[str, ...], Plan]:
        """``claim``'s subscribed handler names and plan, made once (a relay's look-ahead in
        ``relay_claims`` and ``take`` ask for the same)."""
        known = self._plans.pop(claim.token, None)
        if known is not None:
            return known
        names = tuple(subscribed(claim.event.topic))
        return names, plan(claim, names, max_retries=self.max_retries, backoff=self.backoff)

    def check_lease(self, run: EventRun, now: datetime) -> LeaseCheck:
        """R13, before one of ``run``'s handlers starts at ``now`` (local clock)."""
        if run.lost:
            return LeaseCheck.LOST
        if now <= self._held_until:  # what check_lease answers for each deadline of the batch
            return LeaseCheck.HELD
        return check_lease(deadline=self._deadlines[run.claim.token], now=now, lease=self.lease)

    def to_extend(self) -> list[Claim]:
        """Every claim whose lease this poller still needs: the events running, the ones not
        started yet, and the ones delivered but waiting for the round's write."""
        return [
            *(r.claim for r in self._running.values() if not r.lost),
            *self._unstarted,
            *(s.claim for s in self._to_write),
        ]

    def extended(self, asked: Sequence[Claim], kept: Sequence[Claim], now: datetime) -> list[Claim]:
        """The store extended ``kept`` of ``asked`` at ``now`` (local clock). Returns the claims
        it did not keep: their leases are gone (an unstarted one is dropped from the batch, a
        running one is marked lost)."""
        kept_tokens = {c.token for c in kept}
        lost: list[Claim] = []
        if kept:  # what is asked about later was asked now: kept, or lost or dropped below
            self._held_until = held_until(deadline=now + self.lease, lease=self.lease)
        for claim in asked:
            if claim.token in kept_tokens:
                self._deadlines[claim.token] = now + self.lease
                continue
            lost.append(claim)
            if claim in self._unstarted:
                self._unstarted.remove(claim)
                self.report.lease_lost.append(claim.event.id)
            elif claim.token in self._running:
                self.lose(self._running[claim.token])
            else:  # waiting for the round's write: the write will find it stale
                pass
        return lost

    def lose(self, run: EventRun) -> None:
        """``run``'s lease is gone: nothing more is run or written for it."""
        if not run.lost:
            run.lost = True
            self.report.lease_lost.append(run.claim.event.id)

    # -- relays -----------------------------------------------------------------------------------

    def relay_claims(
        self, relay: str, run: EventRun, subscribed: Callable[[str], Sequence[str]]
    ) -> list[Claim]:
        """The claims to hand relay ``relay`` now, in claim order: ``run``'s, and every
        unstarted one whose plan will run it (not yet recorded for it, not settled at once, not
        being published by another of this batch's workers). They count as handed to the relay
        until its answers come (``relayed``) or the publish is given up (``unhanded``).

        Args:
            subscribed: the handler names subscribed to a topic, in order.
        """
        claims = [run.claim]
        for claim in self._unstarted:
            if relay in claim.done or (relay, claim.token) in self._handed:
                continue
            names, planned = self._plans[claim.token] = self._planned(claim, subscribed)
            if relay in names and isinstance(planned, Run) and relay in planned.handlers:
                claims.append(claim)
        self._handed.update((relay, claim.token) for claim in claims)
        return claims

    def is_handed(self, relay: str, claim: Claim) -> bool:
        """Whether ``claim``'s event is being published by ``relay`` (for another worker)."""
        return (relay, claim.token) in self._handed

    def unhanded(self, relay: str, claims: Sequence[Claim]) -> None:
        """The publish of ``claims`` was given up before an answer (the worker was stopped):
        they are no longer handed to ``relay``."""
        self._handed.difference_update((relay, claim.token) for claim in claims)

    def relayed(
        self, relay: str, claims: Sequence[Claim], answers: Sequence[Exception | None]
    ) -> list[Claim]:
        """Keep the broker's answers for ``claims`` (``None``: confirmed). Returns the
        confirmed claims, whose records the shell writes next and reports with ``recorded``
        (until then they stay handed to the relay)."""
        confirmed: list[Claim] = []
        for claim, answer in zip(claims, answers, strict=True):
            self._relayed[relay, claim.token] = answer
            if answer is None:
                confirmed.append(claim)
            else:
                self._handed.discard((relay, claim.token))
        return confirmed

    def recorded(self, relay: str, confirmed: Sequence[Claim], written: Sequence[bool]) -> None:
        """The records of ``confirmed`` (``relayed``'s) were written where ``written`` says:
        a confirm whose record the store refused (its token was stale) is a lost lease."""
        for claim, ok in zip(confirmed, written, strict=True):
            if not ok:
                self._relayed[relay, claim.token] = LeaseLostError(
                    "the lease was lost before the relay's record was written"
                )
            self._handed.discard((relay, claim.token))

    def was_relayed(self, relay: str, claim: Claim) -> bool:
        """Whether ``claim``'s event was handed to ``relay`` in this round already."""
        return (relay, claim.token) in self._relayed

    def relay_result(self, relay: str, claim: Claim) -> Exception | None:
        """The broker's answer for ``claim`` (taken): ``None`` if confirmed and recorded, a
        ``LeaseLostError`` if confirmed but its record was refused, else why it was not."""
        return self._relayed.pop((relay, claim.token))

    # -- what happened ------------------------------------------------------------------------------

    def delivered(self, run: EventRun, delivery: Delivery) -> None:
        """One of ``run``'s handlers ran (``LEASE_LOST``: the lease was lost under it). A run
        that ended the batch's transaction (``BatchRolledBack``) undoes what it held."""
        self.report.deliveries.append(delivery)
        if delivery.outcome is Outcome.LEASE_LOST:
            self.lose(run)
            return
        run.outcomes[delivery.handler] = delivery.outcome
        if delivery.outcome is Outcome.FAILED:
            run.errors.append(f"{delivery.handler}: {delivery.error}")
            if isinstance(delivery.exception, BatchRolledBack):
                self._rolled_back(delivery.exception)

    def _rolled_back(self, rollback: BatchRolledBack) -> None:
        """A handler ended the batch's transaction (R17): the delivery records it held are
        gone, with their handlers' writes. Those handlers did not run after all: the event in
        hand decides its settlement without them (its attempt is spent by the handler that
        failed); an event already finished is not settled but handed back, its attempt
        refunded (``unstarted``), to be delivered again. A lease extension written in that
        transaction is gone too: the leases are back at the claim's deadline."""
        undone: dict[str, list[str]] = {}
        for token, handler in rollback.undone:
            undone.setdefault(token, []).append(handler)
        for token, handlers in undone.items():
            run = self._running.get(token)
            if run is not None:
                for handler in handlers:
                    run.outcomes.pop(handler, None)
                continue
            for settled in self._to_write:
                if settled.claim.token == token:
                    self._to_write.remove(settled)
                    self._handed_back.append(settled.claim)
                    break
        if rollback.extensions_lost:
            for token in self._deadlines:
                self._deadlines[token] = self._claimed_until
            self._held_until = held_until(deadline=self._claimed_until, lease=self.lease)

    def finish(self, run: EventRun) -> Settled | None:
        """R8: decide ``run``'s settlement and queue it for the round's write; None when its
        lease was lost (a stale claim writes nothing)."""
        self._running.pop(run.claim.token, None)
        if run.lost:
            return None
        if isinstance(run.plan, SettleNow):
            settlement: Settlement = run.plan.settlement
            error = run.plan.error
        else:
            settlement = _decide(
                subscribed=run.subscribed,
                outcomes=run.outcomes,
                attempts=run.claim.event.attempts,  # the claim's attempt
                max_retries=self.max_retries,
                backoff=self.backoff,
            )
            notes = run.errors
            if isinstance(settlement, Retry) and settlement.note:
                notes = [*notes, settlement.note]
            error = storable("; ".join(notes)) if notes else None
        settled = Settled(run.claim, settlement, error)
        self._to_write.append(settled)
        return settled

    def to_write(self) -> list[Settled]:
        """The settlements decided since the last write, in order (taken: the caller writes
        them and reports back with :meth:`wrote`)."""
        items, self._to_write = self._to_write, []
        return items

    def wrote(self, items: Sequence[Settled], results: Sequence[bool]) -> list[Claim]:
        """The store wrote ``items``; ``results`` says which it settled. Returns the claims it
        did not (stale: their leases were lost)."""
        lost: list[Claim] = []
        for item, ok in zip(items, results, strict=True):
            if ok:
                self._written.append(item)
            else:
                lost.append(item.claim)
                self.report.lease_lost.append(item.claim.event.id)
        return lost

    def committed(self) -> list[Settled]:
        """What was written is committed (at once per event; at the batch's commit in a
        batch): the settlements to announce, now reported."""
        done, self._written = self._written, []
        published = self.report.published
        by_state = {
            State.PUBLISHED: published,
            State.DEAD: self.report.dead_lettered,
            State.PENDING: self.report.retried,
        }
        for claim, settlement, _ in done:
            if settlement is PUBLISH:  # nearly every one: its state is known
                published.append(claim.event.id)
            else:
                by_state[settlement.state].append(claim.event.id)
        return done

    def unstarted(self) -> list[Claim]:
        """The claims to release, taken: those not started (the poller is stopping), and those
        whose delivered work a handler's rollback of the batch undid (``delivered``)."""
        claims = [*self._handed_back, *self._unstarted]
        self._unstarted.clear()
        self._handed_back.clear()
        for claim in claims:
            self._deadlines.pop(claim.token, None)
        self.report.released.extend(c.event.id for c in claims)
        return claims

    def final_report(self) -> PollReport:
        """The report, each list in claim order (events delivered at once finish in any order;
        an event's deliveries stay in the order its handlers ran)."""
        report = self.report
        order = self._position.__getitem__
        for ids in (
            report.published,
            report.retried,
            report.dead_lettered,
            report.lease_lost,
            report.released,
        ):
            ids.sort(key=order)
        report.deliveries.sort(key=lambda d: order(d.event_id))  # stable: runs stay in order
        return report

    def __len__(self) -> int:
        return len(self._unstarted)
