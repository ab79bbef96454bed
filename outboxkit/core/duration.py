"""Durations given as seconds or ``timedelta``. PURE: values in, a timedelta or a named error out."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from ..errors import ConfigurationError

__all__ = ["MAX_DURATION", "as_timedelta", "before"]

MAX_DURATION = timedelta(days=3660)
"""The longest lease, interval, backoff or retention outboxkit takes: ten years. Far enough for
any schedule, and far enough from ``datetime``'s limits that ``now + duration`` never overflows."""

_EARLIEST = datetime.min.replace(tzinfo=UTC)


def as_timedelta(
    value: object, *, what: str, allow_zero: bool = True, maximum: timedelta | None = None
) -> timedelta:
    """Seconds or a timedelta as a non-negative timedelta, naming ``what`` when it is not one.

    Raises:
        ConfigurationError: (a ``ValueError``) negative (or zero when ``allow_zero`` is
            false), not finite, longer than ``maximum`` (or than a ``timedelta`` can be), or
            not a duration at all.
    """
    if isinstance(value, timedelta):
        delta = value
    elif isinstance(value, int | float) and not isinstance(value, bool):
        try:
            if not math.isfinite(value):
                raise ConfigurationError(f"{what} must be a finite duration, got {value!r}")
            delta = timedelta(seconds=value)
        except OverflowError:
            raise ConfigurationError(
                f"{what} is too large for a duration, got {value!r:.40}"
            ) from None
    else:
        raise ConfigurationError(f"{what} must be seconds or a timedelta, got {value!r:.80}")
    if delta < timedelta(0) or (not allow_zero and delta == timedelta(0)):
        bound = ">= 0 (not negative)" if allow_zero else "> 0"
        raise ConfigurationError(f"{what} must be {bound}, got {value!r}")
    if maximum is not None and delta > maximum:
        raise ConfigurationError(f"{what} must be at most {maximum.days} days, got {value!r:.40}")
    return delta


def before(instant: datetime, delta: timedelta) -> datetime:
    """``instant - delta``, or the earliest instant there is when that would be earlier still
    (a cutoff of "older than 3,000 years" selects nothing rather than overflowing)."""
    try:
        return instant - delta
    except OverflowError:
        return _EARLIEST
