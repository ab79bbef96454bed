"""Durations given as seconds or ``timedelta``. PURE: values in, a timedelta or ValueError out."""

from __future__ import annotations

import math
from datetime import timedelta

__all__ = ["as_timedelta"]


def as_timedelta(value: object, *, what: str, allow_zero: bool = True) -> timedelta:
    """Seconds or a timedelta as a non-negative timedelta, naming ``what`` when it is not one.

    Raises:
        ValueError: negative (or zero when ``allow_zero`` is false), not finite, too large for a
            ``timedelta``, or not a duration at all.
    """
    if isinstance(value, timedelta):
        delta = value
    elif isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"{what} must be a finite duration, got {value!r}")
        try:
            delta = timedelta(seconds=value)
        except OverflowError:
            raise ValueError(f"{what} is too large for a duration, got {value!r}") from None
    else:
        raise ValueError(f"{what} must be seconds or a timedelta, got {value!r}")
    if delta < timedelta(0) or (not allow_zero and delta == timedelta(0)):
        bound = ">= 0 (not negative)" if allow_zero else "> 0"
        raise ValueError(f"{what} must be {bound}, got {value!r}")
    return delta
