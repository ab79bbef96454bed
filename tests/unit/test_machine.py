"""Table-driven tests of the pure lifecycle core (``outboxkit.core.machine``), with plain values only."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from outboxkit import Event, ExponentialBackoff, IllegalTransition, OutboxError, Outcome, State
from outboxkit.core.batch import ClaimedBatch
from outboxkit.core.machine import (
    TRANSITIONS,
    DeadLetter,
    LeaseCheck,
    Publish,
    Retry,
    SettleNow,
    Transition,
    check_lease,
    decide_settlement,
    handlers_to_run,
    held_until,
    is_due,
    lease_is_low,
    plan,
    state_of,
    transition,
)
from outboxkit.core.model import Claim
from outboxkit.core.text import MAX_ERROR_CHARS

# The lifecycle written out independently of the implementation's table (docs/lifecycle.md).
LEGAL: dict[tuple[State, Transition], State] = {
    (State.PENDING, Transition.CLAIM): State.CLAIMED,
    (State.CLAIMED, Transition.LEASE_EXPIRE): State.PENDING,
    (State.CLAIMED, Transition.RELEASE): State.PENDING,
    (State.CLAIMED, Transition.PUBLISH): State.PUBLISHED,
    (State.CLAIMED, Transition.RETRY): State.PENDING,
    (State.CLAIMED, Transition.DEAD_LETTER): State.DEAD,
    (State.DEAD, Transition.REQUEUE): State.PENDING,
}

ALL_PAIRS = list(itertools.product(State, Transition))


def _pair_id(pair: tuple[State, Transition]) -> str:
    return f"{pair[0].name}-{pair[1].name}"


# -- transition ---------------------------------------------------------------------------------


@pytest.mark.parametrize("pair", ALL_PAIRS, ids=_pair_id)
def test_transition_every_state_and_transition(pair: tuple[State, Transition]) -> None:
    state, what = pair
    if pair in LEGAL:
        assert transition(state, what) is LEGAL[pair]
    else:
        with pytest.raises(IllegalTransition) as info:
            transition(state, what)
        message = str(info.value)
        assert state.name in message
        assert what.value in message
        assert info.value.state is state
        assert info.value.what == what.value
        assert isinstance(info.value, OutboxError)


def test_transition_table_is_exactly_the_documented_lifecycle() -> None:
    assert dict(TRANSITIONS) == LEGAL


def test_illegal_transition_names_both_in_message() -> None:
    with pytest.raises(IllegalTransition, match=r"cannot claim an event in state PUBLISHED"):
        transition(State.PUBLISHED, Transition.CLAIM)


# -- decide_settlement --------------------------------------------------------------------------

OK = Outcome.SUCCEEDED
REJ = Outcome.REJECTED
FAIL = Outcome.FAILED
CRASH = Outcome.CRASHED

SETTLE_CASES: list[tuple[str, tuple[str, ...], Mapping[str, Outcome], int, int, object]] = [
    # id, subscribed, outcomes, attempts, max_retries, expected (Publish / DeadLetter / retry no.)
    ("all-succeeded", ("a", "b"), {"a": OK, "b": OK}, 1, 10, Publish()),
    ("succeeded-and-rejected", ("a", "b"), {"a": OK, "b": REJ}, 1, 10, Publish()),
    ("all-rejected", ("a",), {"a": REJ}, 3, 10, Publish()),
    ("no-subscribers", (), {}, 1, 10, Publish()),
    ("no-subscribers-max0", (), {}, 1, 0, Publish()),
    ("no-subscribers-stale-record", (), {"gone": FAIL}, 1, 10, Publish()),
    ("recorded-earlier-past-max", ("a",), {"a": OK}, 12, 10, Publish()),
    ("one-failed-first-attempt", ("a", "b"), {"a": OK, "b": FAIL}, 1, 10, 1),
    ("one-crashed", ("a",), {"a": CRASH}, 2, 10, 2),
    ("missing-outcome-counts-as-failed", ("a", "b"), {"a": OK}, 1, 10, 1),
    ("unsubscribed-outcome-ignored", ("a",), {"z": OK}, 1, 10, 1),
    ("attempts-equal-max-retries", ("a",), {"a": FAIL}, 10, 10, 10),
    ("attempts-max-retries-plus-1", ("a",), {"a": FAIL}, 11, 10, DeadLetter()),
    ("attempts-far-past-max", ("a",), {"a": FAIL}, 50, 10, DeadLetter()),
    ("max0-first-attempt-dead", ("a",), {"a": FAIL}, 1, 0, DeadLetter()),
    ("max0-success-publishes", ("a",), {"a": OK}, 1, 0, Publish()),
    ("max1-first-attempt-retries", ("a",), {"a": FAIL}, 1, 1, 1),
    ("max1-second-attempt-dead", ("a",), {"a": FAIL}, 2, 1, DeadLetter()),
    ("max2-third-attempt-dead", ("a",), {"a": FAIL}, 3, 2, DeadLetter()),
]


@pytest.mark.parametrize(
    ("subscribed", "outcomes", "attempts", "max_retries", "expected"),
    [case[1:] for case in SETTLE_CASES],
    ids=[case[0] for case in SETTLE_CASES],
)
def test_decide_settlement(
    subscribed: tuple[str, ...],
    outcomes: Mapping[str, Outcome],
    attempts: int,
    max_retries: int,
    expected: object,
) -> None:
    policy = ExponentialBackoff()
    decision = decide_settlement(
        subscribed=subscribed,
        outcomes=outcomes,
        attempts=attempts,
        max_retries=max_retries,
        backoff=policy,
    )
    if isinstance(expected, int):
        assert decision == Retry(delay=timedelta(seconds=policy(expected)), retry=expected)
        assert decision.transition is Transition.RETRY
    else:
        assert decision == expected
    # Each decision names a legal move out of CLAIMED.
    assert (State.CLAIMED, decision.transition) in LEGAL


@pytest.mark.parametrize(
    ("attempts", "expected_seconds"),
    [(1, 1), (2, 2), (3, 4), (4, 8), (8, 128), (9, 256), (10, 300)],
)
def test_decide_settlement_retry_uses_the_default_policy(
    attempts: int, expected_seconds: float
) -> None:
    decision = decide_settlement(
        subscribed=("a",),
        outcomes={"a": FAIL},
        attempts=attempts,
        max_retries=10,
        backoff=ExponentialBackoff(),
    )
    assert decision == Retry(delay=timedelta(seconds=expected_seconds), retry=attempts)


def test_decide_settlement_passes_the_attempt_number_to_the_policy() -> None:
    asked: list[int] = []

    def policy(retry: int) -> timedelta:
        asked.append(retry)
        return timedelta(minutes=retry)

    decision = decide_settlement(
        subscribed=("a",), outcomes={}, attempts=3, max_retries=5, backoff=policy
    )
    assert asked == [3]
    assert decision == Retry(delay=timedelta(minutes=3), retry=3)


def test_decide_settlement_does_not_consult_the_policy_when_publishing_or_dead() -> None:
    def policy(retry: int) -> float:
        raise AssertionError("backoff must not be asked")

    publish = decide_settlement(
        subscribed=("a",), outcomes={"a": OK}, attempts=1, max_retries=3, backoff=policy
    )
    dead = decide_settlement(
        subscribed=("a",), outcomes={"a": FAIL}, attempts=4, max_retries=3, backoff=policy
    )
    assert (publish, dead) == (Publish(), DeadLetter())


@pytest.mark.parametrize("attempts", [0, -1])
def test_decide_settlement_refuses_an_unclaimed_attempt_count(attempts: int) -> None:
    with pytest.raises(ValueError, match="attempts"):
        decide_settlement(
            subscribed=("a",),
            outcomes={"a": OK},
            attempts=attempts,
            max_retries=3,
            backoff=ExponentialBackoff(),
        )


def _raises(retry: int) -> float:
    raise RuntimeError("no delay today")


@pytest.mark.parametrize(
    ("policy", "what"),
    [
        (lambda retry: -5, "it returned -5 for retry 2: the delay must be >= 0"),
        (lambda retry: float("nan"), "it returned nan for retry 2"),
        (lambda retry: float("inf"), "it returned inf for retry 2"),
        (lambda retry: "soon", "it returned 'soon' for retry 2"),
        (lambda retry: None, "it returned None for retry 2"),
        (lambda retry: 10**400, "too large for a duration"),
        (lambda retry: timedelta.max, "must be at most 3660 days"),
        (_raises, "no delay today"),
    ],
    ids=["negative", "nan", "inf", "str", "none", "10**400", "timedelta.max", "raises"],
)
def test_a_bad_backoff_still_retries_after_the_default_delay_naming_the_policy(
    policy: Any, what: str
) -> None:
    # The app's policy has a bug: the event is not lost and the loop does not die of it.
    settlement = decide_settlement(
        subscribed=("a",), outcomes={"a": FAIL}, attempts=2, max_retries=3, backoff=policy
    )
    assert isinstance(settlement, Retry)
    assert (settlement.delay, settlement.retry) == (timedelta(seconds=2), 2)  # the default's
    assert settlement.note is not None
    assert settlement.note.startswith("backoff ")
    assert what in settlement.note
    assert settlement.note.endswith("retried after the default 2s")


# -- is_due (R2) --------------------------------------------------------------------------------

NOW = datetime(2030, 1, 1, tzinfo=UTC)
SEC = timedelta(seconds=1)

DUE_CASES = [
    # id, published_at, failed_at, available_at, locked_until, expected
    ("fresh", None, None, NOW - SEC, None, True),
    ("available-exactly-now", None, None, NOW, None, True),
    ("available-later", None, None, NOW + SEC, None, False),
    ("published", NOW - SEC, None, NOW - SEC, None, False),
    ("dead", None, NOW - SEC, NOW - SEC, None, False),
    ("published-and-dead", NOW, NOW, NOW - SEC, None, False),
    ("leased", None, None, NOW - SEC, NOW + SEC, False),
    ("lease-ends-exactly-now", None, None, NOW - SEC, NOW, True),
    ("lease-expired", None, None, NOW - SEC, NOW - SEC, True),
    ("leased-and-not-yet-available", None, None, NOW + SEC, NOW + SEC, False),
    ("lease-expired-not-yet-available", None, None, NOW + SEC, NOW - SEC, False),
    ("dead-with-expired-lease", None, NOW - SEC, NOW - SEC, NOW - SEC, False),
]


@pytest.mark.parametrize(
    ("published_at", "failed_at", "available_at", "locked_until", "expected"),
    [case[1:] for case in DUE_CASES],
    ids=[case[0] for case in DUE_CASES],
)
def test_is_due(
    published_at: datetime | None,
    failed_at: datetime | None,
    available_at: datetime,
    locked_until: datetime | None,
    expected: bool,
) -> None:
    assert (
        is_due(
            published_at=published_at,
            failed_at=failed_at,
            available_at=available_at,
            locked_until=locked_until,
            now=NOW,
        )
        is expected
    )


# -- state_of -----------------------------------------------------------------------------------

STATE_CASES = [
    # id, published_at, failed_at, locked_until, expected
    ("pending", None, None, None, State.PENDING),
    ("claimed", None, None, NOW + SEC, State.CLAIMED),
    ("lease-ends-now-is-pending", None, None, NOW, State.PENDING),
    ("lease-expired-is-pending", None, None, NOW - SEC, State.PENDING),
    ("published", NOW, None, None, State.PUBLISHED),
    ("published-wins-over-lease", NOW, None, NOW + SEC, State.PUBLISHED),
    ("published-wins-over-dead", NOW, NOW, None, State.PUBLISHED),
    ("dead", None, NOW, None, State.DEAD),
    ("dead-wins-over-lease", None, NOW, NOW + SEC, State.DEAD),
]


@pytest.mark.parametrize(
    ("published_at", "failed_at", "locked_until", "expected"),
    [case[1:] for case in STATE_CASES],
    ids=[case[0] for case in STATE_CASES],
)
def test_state_of(
    published_at: datetime | None,
    failed_at: datetime | None,
    locked_until: datetime | None,
    expected: State,
) -> None:
    assert (
        state_of(published_at=published_at, failed_at=failed_at, locked_until=locked_until, now=NOW)
        is expected
    )


# -- handlers_to_run (R5) -----------------------------------------------------------------------

RUN_CASES = [
    # id, subscribed, done, expected
    ("nothing-done", ["a", "b", "c"], [], ["a", "b", "c"]),
    ("order-kept-not-alphabetical", ["c", "a", "b"], [], ["c", "a", "b"]),
    ("first-done", ["a", "b", "c"], ["a"], ["b", "c"]),
    ("middle-done", ["c", "a", "b"], ["a"], ["c", "b"]),
    ("all-done", ["a", "b"], ["b", "a"], []),
    ("unknown-done-ignored", ["a", "b"], ["zzz"], ["a", "b"]),
    ("no-subscribers", [], ["a"], []),
]


@pytest.mark.parametrize(
    ("subscribed", "done", "expected"),
    [case[1:] for case in RUN_CASES],
    ids=[case[0] for case in RUN_CASES],
)
def test_handlers_to_run(subscribed: list[str], done: list[str], expected: list[str]) -> None:
    assert handlers_to_run(subscribed, done) == expected


def test_handlers_to_run_accepts_a_one_shot_iterable_and_a_mapping() -> None:
    assert handlers_to_run(["a", "b", "c"], (n for n in ["b"])) == ["a", "c"]
    assert handlers_to_run(("a", "b"), {"a": Outcome.REJECTED}) == ["b"]


# -- lease_is_low (R13) -------------------------------------------------------------------------

LEASE = timedelta(seconds=30)


@pytest.mark.parametrize(
    ("remaining", "expected"),
    [
        (timedelta(seconds=30), False),
        (timedelta(seconds=16), False),
        (timedelta(seconds=15), False),  # exactly half: not yet
        (timedelta(seconds=14.999), True),
        (timedelta(seconds=1), True),
        (timedelta(0), True),
        (timedelta(seconds=-5), True),  # already gone
    ],
)
def test_lease_is_low(remaining: timedelta, expected: bool) -> None:
    assert lease_is_low(remaining=remaining, lease=LEASE) is expected


# -- held_until, and a batch's lease checks (R13) -----------------------------------------------

US = timedelta(microseconds=1)
OFFSETS = [timedelta(0), US, 14 * SEC, 15 * SEC - US, 15 * SEC, 15 * SEC + US, 29 * SEC, 30 * SEC]


@pytest.mark.parametrize("lease", [LEASE, timedelta(microseconds=3), timedelta(seconds=7)])
def test_held_until_is_the_last_instant_check_lease_says_held(lease: timedelta) -> None:
    deadline = NOW + lease
    last = held_until(deadline=deadline, lease=lease)
    assert check_lease(deadline=deadline, now=last, lease=lease) is LeaseCheck.HELD
    assert check_lease(deadline=deadline, now=last + US, lease=lease) is not LeaseCheck.HELD


def _claim(event_id: int) -> Claim:
    event = Event(event_id, "t", {}, {}, None, NOW, NOW, 1, None, None, NOW + LEASE, None)
    return Claim(event, f"token-{event_id}", NOW + LEASE)


def test_a_batch_checks_each_lease_as_the_machine_does_before_and_after_an_extension() -> None:
    """The batch answers HELD without a look at the deadline while every lease is far off
    (held_until): the same answer as check_lease, at every instant around the thresholds."""
    claims = [_claim(1), _claim(2)]
    batch = ClaimedBatch(
        claims, claimed_at=NOW, lease=LEASE, max_retries=3, backoff=ExponentialBackoff()
    )
    run = batch.take(lambda topic: ("h",))
    assert run is not None
    for offset in OFFSETS:
        expected = check_lease(deadline=NOW + LEASE, now=NOW + offset, lease=LEASE)
        assert batch.check_lease(run, NOW + offset) is expected, offset
    extended_at = NOW + 20 * SEC
    assert batch.extended(claims, claims[:1], extended_at) == claims[1:]
    for offset in OFFSETS:
        now = extended_at + offset
        expected = check_lease(deadline=extended_at + LEASE, now=now, lease=LEASE)
        assert batch.check_lease(run, now) is expected, offset


# -- attempts used up before the claim (plan) ---------------------------------------------------


def _used_up(attempts: int, last_error: str | None, done: dict[str, Outcome] | None = None):
    """A claim whose earlier attempts left ``last_error`` (None: they left no error)."""
    event = Event(7, "t", {}, {}, None, NOW, NOW, attempts, None, None, NOW + LEASE, last_error)
    return Claim(event, "token-7", NOW + LEASE, done or {})


def test_max_retries_lowered_keeps_the_real_error_first() -> None:
    """Bug 9: an event that failed once ("smtp busy"), claimed again under max_retries=0, is
    dead without a run, and its error is still the handler's, not a crash that never was."""
    decided = plan(
        _used_up(2, "send: RuntimeError: smtp busy"),
        ("send",),
        max_retries=0,
        backoff=ExponentialBackoff(),
    )
    assert isinstance(decided, SettleNow)
    assert decided.settlement == DeadLetter()
    assert decided.error == (
        "send: RuntimeError: smtp busy; no attempt left to run it (attempt 2, max_retries=0)"
    )
    assert "crashed" not in decided.error


def test_attempts_used_up_without_an_earlier_error_blames_a_crash_or_a_lost_lease() -> None:
    decided = plan(_used_up(2, None), ("send",), max_retries=0, backoff=ExponentialBackoff())
    assert decided == SettleNow(
        DeadLetter(), "attempts used up: attempt 1 crashed or lost its lease"
    )


def test_attempts_used_up_with_every_handler_recorded_publishes_without_an_error() -> None:
    claim = _used_up(3, "send: RuntimeError: smtp busy", {"send": Outcome.SUCCEEDED})
    decided = plan(claim, ("send",), max_retries=1, backoff=ExponentialBackoff())
    assert decided == SettleNow(Publish())


def test_attempts_used_up_cuts_a_long_real_error_but_keeps_the_note() -> None:
    long_error = "send: RuntimeError: " + "x" * (2 * MAX_ERROR_CHARS)
    decided = plan(_used_up(5, long_error), ("send",), max_retries=3, backoff=ExponentialBackoff())
    assert isinstance(decided, SettleNow) and decided.error is not None
    assert len(decided.error) <= MAX_ERROR_CHARS
    assert decided.error.startswith("send: RuntimeError: xxx")
    assert decided.error.endswith("; no attempt left to run it (attempt 5, max_retries=3)")
