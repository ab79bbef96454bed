"""Backoff policies (R10): the default schedule, options, jitter, and turning values into delays."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest

from outboxkit import ExponentialBackoff
from outboxkit.core.backoff import as_policy, delay_for

DEFAULT_SCHEDULE = [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]


def test_default_schedule_doubles_from_one_second_and_caps_at_300() -> None:
    policy = ExponentialBackoff()
    assert [policy(n) for n in range(1, 12)] == DEFAULT_SCHEDULE
    assert (policy.base, policy.max, policy.jitter) == (1.0, 300.0, 0.0)


def test_default_schedule_stays_capped_for_huge_retry_numbers() -> None:
    policy = ExponentialBackoff()
    assert policy(64) == 300
    assert policy(10_000) == 300
    assert policy(10**18) == 300


@pytest.mark.parametrize(
    ("base", "cap", "expected"),
    [
        (0.5, 10.0, [0.5, 1, 2, 4, 8, 10, 10]),
        (3, 1000, [3, 6, 12, 24, 48, 96, 192]),
        (10, 5, [5, 5, 5, 5, 5, 5, 5]),  # the cap wins even over the base
        (0.001, 0.002, [0.001, 0.002, 0.002, 0.002, 0.002, 0.002, 0.002]),
    ],
)
def test_custom_base_and_max(base: float, cap: float, expected: list[float]) -> None:
    policy = ExponentialBackoff(base=base, max=cap)
    assert [policy(n) for n in range(1, 8)] == pytest.approx(expected)


@pytest.mark.parametrize("retry", [0, -1])
def test_retry_numbers_start_at_one(retry: int) -> None:
    with pytest.raises(ValueError, match="start at 1"):
        ExponentialBackoff()(retry)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("base", 0),
        ("base", -1.0),
        ("base", float("nan")),
        ("base", float("inf")),
        ("base", True),
        ("base", "1"),
        ("base", None),
        ("max", 0),
        ("max", -300),
        ("max", float("nan")),
        ("max", float("inf")),
        ("max", "300"),
        ("jitter", -0.1),
        ("jitter", 1.5),
        ("jitter", float("nan")),
        ("jitter", "0.5"),
        ("jitter", None),
    ],
)
def test_invalid_options_raise_value_error_naming_the_option(option: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"backoff {option} must"):
        ExponentialBackoff(**{option: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("jitter", [0.0, 0.5, 1.0, 1])
def test_jitter_bounds_are_accepted(jitter: float) -> None:
    assert ExponentialBackoff(jitter=jitter).jitter == jitter


@pytest.mark.parametrize("jitter", [0.1, 0.5, 1.0])
def test_jitter_stays_inside_its_bounds(monkeypatch: pytest.MonkeyPatch, jitter: float) -> None:
    # A seeded generator of our own: reproducible, and the global random state is left alone.
    monkeypatch.setattr("outboxkit.core.backoff.random.random", random.Random(1234).random)
    policy = ExponentialBackoff(jitter=jitter)
    for retry in (1, 4, 9, 20):
        full = min(2.0 ** (retry - 1), 300.0)
        samples = [policy(retry) for _ in range(500)]
        assert all(full * (1 - jitter) <= s <= full for s in samples)
        # It really spreads: not every sample is the undelayed value.
        assert min(samples) < full * (1 - jitter / 2)


@pytest.mark.parametrize(("draw", "expected"), [(0.0, 8.0), (0.5, 6.0), (0.999999, 4.000004)])
def test_jitter_scales_the_random_draw(
    monkeypatch: pytest.MonkeyPatch, draw: float, expected: float
) -> None:
    monkeypatch.setattr("outboxkit.core.backoff.random.random", lambda: draw)
    assert ExponentialBackoff(jitter=0.5)(4) == pytest.approx(expected)


def test_no_jitter_never_draws_a_random_number(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> float:
        raise AssertionError("random drawn without jitter")

    monkeypatch.setattr("outboxkit.core.backoff.random.random", boom)
    assert ExponentialBackoff()(3) == 4


# -- delay_for / as_policy ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, timedelta(0)),
        (1.5, timedelta(seconds=1.5)),
        (7, timedelta(seconds=7)),
        (timedelta(minutes=2), timedelta(minutes=2)),
        (timedelta(0), timedelta(0)),
    ],
)
def test_delay_for_accepts_seconds_and_timedeltas(value: object, expected: timedelta) -> None:
    assert delay_for(lambda retry: value, 1) == expected  # type: ignore[arg-type,return-value]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-1, "negative"),
        (-0.001, "negative"),
        (timedelta(seconds=-1), "negative"),
        (float("nan"), "finite"),
        (float("inf"), "finite"),
        (float("-inf"), "finite"),
        (1e300, "too large"),
        (True, "seconds or a timedelta"),
        ("5", "seconds or a timedelta"),
        (None, "seconds or a timedelta"),
        ([1], "seconds or a timedelta"),
    ],
)
def test_delay_for_rejects_bad_policy_values(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        delay_for(lambda retry: value, 3)  # type: ignore[arg-type,return-value]
    assert "retry 3" in str(info.value)


def test_delay_for_passes_the_retry_number() -> None:
    assert delay_for(lambda retry: retry * 10.0, 4) == timedelta(seconds=40)
    assert delay_for(ExponentialBackoff(), 11) == timedelta(seconds=300)


def test_as_policy() -> None:
    assert as_policy(None) == ExponentialBackoff()

    def mine(retry: int) -> float:
        return 1.0

    assert as_policy(mine) is mine
    with pytest.raises(ValueError, match="backoff must be a callable"):
        as_policy(5)  # type: ignore[arg-type]


def test_exponential_backoff_is_frozen() -> None:
    policy = ExponentialBackoff()
    with pytest.raises(AttributeError):
        policy.base = 2  # type: ignore[misc]
