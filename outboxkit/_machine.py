"""The event lifecycle as a pure state machine.

RULES FOR THIS FILE: no I/O, no clock, no logging, no driver, no pluggy. Every input is a plain
value passed in; every output is a plain value or a named error. Time is relative here: the
machine says "retry after 4 s" or "lease for 30 s", the store turns that into timestamps with the
clock the outbox was given. Anything that needs a database or the wall clock lives elsewhere.

Theory of operation
-------------------
An event is PENDING from the moment its enqueueing transaction commits. A poller *claims* a batch
of due events (R2, R3): each claim sets a lease, counts the attempt (R4) and hands out a fresh token.
The poller then delivers the event to every subscribed handler that has no delivery record yet
(R5-R7) and *settles* it (R8), fenced by the token:

    every handler succeeded or rejected  -> PUBLISHED
    else attempts > max_retries          -> DEAD (until requeued, R12)
    else                                 -> PENDING again, available after backoff(attempts) (R10)

A poller that dies leaves its events CLAIMED until the lease runs out; then they are due again
(R13). A stale token - the lease ran out and someone else claimed the event - changes nothing.

    enqueue --> PENDING --claim--> CLAIMED --settle--> PUBLISHED
                  ^                  |  |
                  +--retry/release---+  +--settle (attempts > max_retries)--> DEAD
                  +---------------------------requeue----------------------------+

The transitions are data (``TRANSITIONS``); ``transition`` raises ``IllegalTransition`` for a
pair that is not in the table.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from ._backoff import BackoffPolicy, delay_for
from ._model import Outcome, State
from .errors import IllegalTransition

__all__ = [
    "DeadLetter",
    "Publish",
    "Retry",
    "Settlement",
    "TRANSITIONS",
    "Transition",
    "decide_settlement",
    "handlers_to_run",
    "is_due",
    "lease_is_low",
    "state_of",
    "transition",
]


class Transition(enum.Enum):
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


def transition(state: State, what: Transition) -> State:
    """The state after ``what`` happens in ``state``.

    Raises:
        IllegalTransition: the table has no such pair (e.g. claiming a published event).
    """
    try:
        return TRANSITIONS[(state, what)]
    except KeyError:
        raise IllegalTransition(state, what.value) from None


def state_of(
    *,
    published_at: datetime | None,
    failed_at: datetime | None,
    locked_until: datetime | None,
    now: datetime,
) -> State:
    """The lifecycle state of a stored row at ``now``."""
    if published_at is not None:
        return State.PUBLISHED
    if failed_at is not None:
        return State.DEAD
    if locked_until is not None and locked_until > now:
        return State.CLAIMED
    return State.PENDING


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
        published_at is None
        and failed_at is None
        and available_at <= now
        and (locked_until is None or locked_until <= now)
    )


def handlers_to_run(subscribed: Sequence[str], done: Iterable[str]) -> list[str]:
    """R5: the subscribed handlers, in subscription order, that have no delivery record yet."""
    recorded = set(done)
    return [name for name in subscribed if name not in recorded]


# -- settlement ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Publish:
    transition: Transition = Transition.PUBLISH


@dataclass(frozen=True, slots=True)
class Retry:
    delay: timedelta
    retry: int  # 1 for the first retry
    transition: Transition = Transition.RETRY


@dataclass(frozen=True, slots=True)
class DeadLetter:
    transition: Transition = Transition.DEAD_LETTER


Settlement = Publish | Retry | DeadLetter


def decide_settlement(
    *,
    subscribed: Sequence[str],
    outcomes: Mapping[str, Outcome],
    attempts: int,
    max_retries: int,
    backoff: BackoffPolicy,
) -> Settlement:
    """R8: what becomes of a claimed event once its handlers have run.

    Args:
        subscribed: the handler names subscribed to the event's topic.
        outcomes: the outcome of each handler so far (recorded earlier or in this attempt).
        attempts: the attempts counted so far, this one included (R4).
        max_retries: how many retries are allowed after the first attempt (R11).
        backoff: the retry-delay policy (R10).

    Raises:
        ValueError: ``attempts`` is below 1 or the policy returned a bad delay.
    """
    if attempts < 1:
        raise ValueError(f"a settled event has been claimed at least once, got attempts={attempts}")
    if all(outcomes.get(name, Outcome.FAILED).recorded for name in subscribed):
        return Publish()
    if attempts > max_retries:
        return DeadLetter()
    return Retry(delay=delay_for(backoff, attempts), retry=attempts)


def lease_is_low(*, remaining: timedelta, lease: timedelta) -> bool:
    """R13: extend the batch's leases once less than half of a lease is left."""
    return remaining < lease / 2
