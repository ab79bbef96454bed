"""The event lifecycle as a pure state machine: states, transitions, and every decision.

RULE 1 OF THIS FILE: everything that decides what happens to an event lives here. Which
handlers run (R5), whether an event holds up the later events of its key (R15), whether an
event is settled at once (unrouted, undecodable, attempts used up), what a settlement is (R8,
R10, R11), whether a lease is held, must be extended or is gone (R13), how long a poller waits
out an outage. The pollers (``outboxkit.poller``, ``outboxkit.aio``) ask and carry out; the
stores write what they are told, each write one of ``TRANSITIONS``.

RULE 2: no I/O, no clock, no logging, no driver, no pluggy. Every input is a plain value passed
in, the instant included; every output is a plain value or a named error. Time is relative: the
machine says "retry after 4 s", "the lease is low", and the caller turns that into timestamps.

The rules R1-R16 are written out in ``docs/lifecycle.md``.

    enqueue --> PENDING --claim--> CLAIMED --settle--> PUBLISHED
                  ^                  |  |
                  +--retry/release---+  +--settle (attempts > max_retries)--> DEAD
                  +---------------------------requeue----------------------------+

The transitions are data (``TRANSITIONS``), consulted whenever a state changes: a settlement's
target state is ``transition(CLAIMED, settlement.transition)``, a requeue's is
``transition(DEAD, REQUEUE)``; a pair missing from the table raises ``IllegalTransition``.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from ..errors import ConfigurationError, IllegalTransition, Reject
from .backoff import BackoffPolicy, ExponentialBackoff, delay_for
from .model import (
    Claim,
    DeadKey,
    Outcome,
    State,
    UndecodablePayload,
    payload_is_undecodable,
    state_of,
)
from .text import MAX_ERROR_CHARS, storable

__all__ = [
    "MAX_OUTAGE_WAIT",
    "PUBLISH",
    "TRANSITIONS",
    "DeadLetter",
    "LeaseCheck",
    "Plan",
    "Publish",
    "Retry",
    "Run",
    "Settlement",
    "SettleNow",
    "Transition",
    "allowed",
    "blocks_key",
    "check_lease",
    "decide_settlement",
    "handlers_to_run",
    "is_due",
    "held_until",
    "lease_is_low",
    "lost_of",
    "outage_delay",
    "outcome_of",
    "plan",
    "state_of",
    "transition",
    "used_up_error",
]


class Transition(enum.Enum):
    __hash__ = object.__hash__  # identity, as ``State`` (the table's keys hash it)

    CLAIM = "claim"  # R3: a due event is leased to one poller
    LEASE_EXPIRE = "lease_expire"  # R13: the lease ran out; the event is due again
    RELEASE = "release"  # a stopping poller hands back an event it has not started
    PUBLISH = "publish"  # R8: every handler recorded (R9: or no handler at all)
    RETRY = "retry"  # R8/R10: some handler failed; due again after the backoff
    DEAD_LETTER = "dead_letter"  # R8/R11: some handler failed and the retries are used up
    REQUEUE = "requeue"  # R12: an operator sends a dead event round again


TRANSITIONS: Mapping[tuple[State, Transition], State] = {
    (State.PENDING, Transition.CLAIM): State.CLAIMED,
    (State.CLAIMED, Transition.LEASE_EXPIRE): State.PENDING,
    (State.CLAIMED, Transition.RELEASE): State.PENDING,
    (State.CLAIMED, Transition.PUBLISH): State.PUBLISHED,
    (State.CLAIMED, Transition.RETRY): State.PENDING,
    (State.CLAIMED, Transition.DEAD_LETTER): State.DEAD,
    (State.DEAD, Transition.REQUEUE): State.PENDING,
}


def allowed(state: State, what: Transition) -> bool:
    """Whether the table has ``what`` out of ``state``."""
    return (state, what) in TRANSITIONS


def transition(state: State, what: Transition) -> State:
    """The state after ``what`` happens in ``state``.

    Raises:
        IllegalTransition: the table has no such pair (e.g. claiming a published event).
    """
    try:
        return TRANSITIONS[(state, what)]
    except KeyError:
        raise IllegalTransition(state, what.value) from None


def is_due(
    *,
    published_at: datetime | None,
    failed_at: datetime | None,
    available_at: datetime,
    locked_until: datetime | None,
    now: datetime,
) -> bool:
    """R2: not published, not dead, available, and not leased."""
    return (
        state_of(published_at=published_at, failed_at=failed_at, locked_until=locked_until, now=now)
        is State.PENDING
        and available_at <= now
    )


KEY_BLOCKERS: Mapping[DeadKey, frozenset[State]] = {
    "release": frozenset({State.PENDING, State.CLAIMED}),
    "hold": frozenset({State.PENDING, State.CLAIMED, State.DEAD}),
}
"""R15 as data: the states in which an event holds up the later events of its key, by the
outbox's ``dead_key``. Pending covers waiting for a retry; a published event never holds."""


def blocks_key(state: State, dead_key: DeadKey) -> bool:
    """R15: whether an event in ``state`` keeps the later events of its key from being claimed.

    Raises:
        ConfigurationError: ``dead_key`` is neither ``"release"`` nor ``"hold"``.
    """
    try:
        return state in KEY_BLOCKERS[dead_key]
    except KeyError:
        raise ConfigurationError(
            f"dead_key must be 'release' or 'hold', got {dead_key!r}"
        ) from None


def handlers_to_run(subscribed: Sequence[str], done: Iterable[str]) -> list[str]:
    """R5: the subscribed handlers, in subscription order, that have no delivery record yet."""
    recorded = set(done)
    return [name for name in subscribed if name not in recorded]


def outcome_of(exc: BaseException | None) -> Outcome:
    """R6: what a handler's run ended with: returned (succeeded), raised ``Reject``
    (rejected), raised another ``Exception`` (failed: retried), or a ``BaseException``
    such as ``KeyboardInterrupt`` (crashed: nothing recorded, the lease recovers it)."""
    if exc is None:
        return Outcome.SUCCEEDED
    if isinstance(exc, Reject):
        return Outcome.REJECTED
    if isinstance(exc, Exception):
        return Outcome.FAILED
    return Outcome.CRASHED


# -- settlement ---------------------------------------------------------------------------------


@functools.cache
def _after_claim(move: Transition) -> State:
    """The state ``move`` leads to from CLAIMED (``transition``'s table), kept: a settlement's
    state is asked for every event settled. An illegal move raises every time."""
    return transition(State.CLAIMED, move)


@dataclass(frozen=True, slots=True)
class Publish:
    """R8: every subscribed handler succeeded or rejected the event (R9: or there is none)."""

    transition: Transition = Transition.PUBLISH

    @property
    def state(self) -> State:
        return _after_claim(self.transition)


@dataclass(frozen=True, slots=True)
class Retry:
    """R8, R10: due again after ``delay``. ``note`` says why the delay is not the backoff's own
    (a backoff that returned something that is not a duration): it joins the event's error."""

    delay: timedelta
    retry: int  # 1 for the first retry
    note: str | None = None
    transition: Transition = Transition.RETRY

    @property
    def state(self) -> State:
        return _after_claim(self.transition)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """R8, R11: the retries are used up; dead until requeued (R12)."""

    transition: Transition = Transition.DEAD_LETTER

    @property
    def state(self) -> State:
        return _after_claim(self.transition)


Settlement = Publish | Retry | DeadLetter

PUBLISH = Publish()
"""The one ``Publish`` settlement (it holds nothing: every event that publishes shares it)."""
_RECORDED = frozenset(outcome for outcome in Outcome if outcome.recorded)

_FALLBACK_BACKOFF = ExponentialBackoff()


def decide_settlement(
    *,
    subscribed: Sequence[str],
    outcomes: Mapping[str, Outcome],
    attempts: int,
    max_retries: int,
    backoff: BackoffPolicy,
) -> Settlement:
    """R8: what becomes of a claimed event once its handlers have run.

    A backoff that raises or returns something that is not a duration >= 0 (a bug in the app's
    policy) does not stop the event: it is retried after the default delay for that retry, and
    the ``Retry``'s ``note`` names the policy and what it did.

    Args:
        subscribed: the handler names subscribed to the event's topic.
        outcomes: the outcome of each handler so far (recorded earlier or in this attempt).
        attempts: the attempts counted so far, this one included (R4).
        max_retries: how many retries are allowed after the first attempt (R11).
        backoff: the retry-delay policy (R10).

    Raises:
        ConfigurationError: ``attempts`` is below 1 (a settled event was claimed at least once).
    """
    if attempts < 1:
        raise ConfigurationError(
            f"a settled event has been claimed at least once, got attempts={attempts}"
        )
    for name in subscribed:
        if outcomes.get(name) not in _RECORDED:
            break
    else:
        return PUBLISH
    if attempts > max_retries:
        return DeadLetter()
    try:
        return Retry(delay=delay_for(backoff, attempts), retry=attempts)
    except Exception as exc:  # the app's policy: any bug of it must not stop delivery
        fallback = delay_for(_FALLBACK_BACKOFF, attempts)
        note = storable(
            f"backoff {_name_of(backoff)} failed for retry {attempts} ({exc}); retried after "
            f"the default {fallback.total_seconds():g}s"
        )
        return Retry(delay=fallback, retry=attempts, note=note)


def _name_of(policy: object) -> str:
    name = getattr(policy, "__qualname__", None) or type(policy).__name__
    return f"{name!s:.80}"


# -- planning one claimed event -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Run:
    """Run these handlers, in this order (R5: the subscribed ones without a record)."""

    handlers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SettleNow:
    """Run nothing; settle the event as it stands.

    ``unrouted`` marks R9 (no handler is subscribed to the topic).
    """

    settlement: Settlement
    error: str | None = None
    unrouted: bool = False


Plan = Run | SettleNow


def plan(
    claim: Claim, subscribed: Sequence[str], *, max_retries: int, backoff: BackoffPolicy
) -> Plan:
    """What a poller does with a freshly claimed event.

    - A stored payload that is not JSON (written behind outboxkit's back) can never be
      delivered: dead-lettered at once, naming the error.
    - R9: no handler subscribed: published at once.
    - R4 + R11: the earlier attempts used every attempt up without settling it dead (they
      crashed or lost their lease, or ``max_retries`` was lowered since they failed): run
      nothing (a poison event must not crash pollers forever) and settle it as it stands:
      published if every handler is recorded, else dead. A dead one keeps its real error: the
      event's ``last_error`` (the last failure of a handler), first, then a note that no
      attempt was left; only an event that never failed is said to have crashed or lost its
      lease.
    - R5: otherwise run the subscribed handlers that have no record yet, in subscription
      order; if every one has, it is published.
    """
    if payload_is_undecodable(claim.event):
        undecodable: UndecodablePayload = claim.event.payload
        return SettleNow(DeadLetter(), storable(undecodable.error))
    if not subscribed:
        return SettleNow(PUBLISH, unrouted=True)
    if claim.event.attempts > max_retries + 1:
        settlement = decide_settlement(
            subscribed=subscribed,
            outcomes=claim.done,
            attempts=claim.attempt,
            max_retries=max_retries,
            backoff=backoff,
        )
        if isinstance(settlement, Publish):
            return SettleNow(settlement)
        return SettleNow(settlement, used_up_error(claim, max_retries=max_retries))
    if not claim.done:  # nothing recorded yet (nearly every claim): every handler runs
        return _run_all(tuple(subscribed))
    to_run = handlers_to_run(subscribed, claim.done)
    if not to_run:
        return SettleNow(PUBLISH)
    return Run(tuple(to_run))


def used_up_error(claim: Claim, *, max_retries: int) -> str:
    """The error kept with an event dead-lettered because its attempts were used up before
    this one (``plan``): its own last error first, when it has one, then a note that no attempt
    was left; without one, the attempt before this one crashed or lost its lease (R4: nothing
    else uses an attempt up without leaving an error).

    Args:
        claim: the claim that found the attempts used up (its event's ``last_error`` as stored).
        max_retries: the retries allowed after the first attempt (R11).
    """
    earlier = claim.event.last_error
    if not earlier:
        return f"attempts used up: attempt {claim.attempt - 1} crashed or lost its lease"
    note = f"no attempt left to run it (attempt {claim.attempt}, max_retries={max_retries})"
    # The note goes last and the error is cut to fit the store's limit (``storable``): the
    # real error is kept whole when anything has to go.
    tail = f"; {note}"
    return storable(earlier, limit=MAX_ERROR_CHARS - len(tail)) + tail


@functools.lru_cache(maxsize=1024)
def _run_all(subscribed: tuple[str, ...]) -> Run:
    """``Run(subscribed)``, one per tuple of names (a ``Run`` is immutable: plans share it)."""
    return Run(subscribed)


# -- leases and outages ------------------------------------------------------------------------


class LeaseCheck(enum.Enum):
    """R13, before a handler starts: what the poller must do about the batch's leases."""

    HELD = "held"  # enough of the lease is left: go on
    EXTEND = "extend"  # less than half a lease is left: extend the batch's leases first
    LOST = "lost"  # the lease is gone: start nothing more for this event


def lease_is_low(*, remaining: timedelta, lease: timedelta) -> bool:
    """R13: extend the batch's leases once less than half of a lease is left."""
    return remaining < lease / 2


def held_until(*, deadline: datetime, lease: timedelta) -> datetime:
    """R13: the last instant at which ``check_lease`` says HELD for ``deadline`` (after it,
    less than half a lease is left): a batch whose deadlines are all at least ``deadline``
    needs no closer look before then."""
    return deadline - lease / 2


def check_lease(*, deadline: datetime, now: datetime, lease: timedelta) -> LeaseCheck:
    """R13: the lease of an event whose local deadline is ``deadline``, at ``now`` (both by the
    poller's local clock: monotonic in production)."""
    if now >= deadline:
        return LeaseCheck.LOST
    if lease_is_low(remaining=deadline - now, lease=lease):
        return LeaseCheck.EXTEND
    return LeaseCheck.HELD


def lost_of(asked: Sequence[Claim], kept: Sequence[Claim]) -> list[Claim]:
    """R13: the claims of ``asked`` that an extension did not keep (their leases are gone)."""
    tokens = {claim.token for claim in kept}
    return [claim for claim in asked if claim.token not in tokens]


def prefetches(*, enabled: bool, claimed: int, batch_size: int) -> bool:
    """Whether a poller claims its next batch while the one in hand is delivered (the
    ``prefetch`` option): only after a claim that filled a batch, that is while it drains a
    backlog (one that found less is about to wait, and would hold leases for nothing). An
    empty claim made so is never taken as the end of the work: the batch delivered meanwhile
    may have enqueued follow-ups, so the shell claims once more before it waits or stops."""
    return enabled and claimed >= batch_size


MAX_OUTAGE_WAIT = 30.0
"""The longest a poller waits between two tries while the store is unavailable (seconds)."""


def outage_delay(failures: int, interval: float) -> float:
    """Seconds to wait after ``failures`` failed polls in a row: ``interval`` doubled with every
    failure, at most ``MAX_OUTAGE_WAIT``."""
    return min(interval * 2.0 ** min(max(failures, 1), 16), MAX_OUTAGE_WAIT)
