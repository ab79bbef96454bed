"""Backoff policies (R10).

PURE: no clock, no I/O. A policy maps the retry number (1 for the first retry) to a delay.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeGuard

from ..errors import ConfigurationError
from .duration import MAX_DURATION, as_timedelta

__all__ = ["BackoffPolicy", "ExponentialBackoff", "as_policy", "delay_for"]

BackoffPolicy = Callable[[int], "float | timedelta"]
"""Any callable ``backoff(retry: int) -> seconds | timedelta``; ``retry`` counts from 1."""


@dataclass(frozen=True, slots=True)
class ExponentialBackoff:
    """Retry *n* waits ``min(base * 2**(n-1), max)`` seconds; 1 s, 2 s, 4 s, ... 300 s by default.

    ``jitter`` (0..1) spreads each delay uniformly over ``[delay * (1 - jitter), delay]``; it is
    off by default so schedules are reproducible.

    Raises:
        ConfigurationError: ``base`` or ``max`` is not > 0, or ``jitter`` is outside 0..1.
    """

    base: float = 1.0
    max: float = 300.0
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if not _positive(self.base):
            raise ConfigurationError(f"backoff base must be > 0 seconds, got {self.base!r}")
        if not _positive(self.max):
            raise ConfigurationError(f"backoff max must be > 0 seconds, got {self.max!r}")
        if not (_number(self.jitter) and 0.0 <= self.jitter <= 1.0):
            raise ConfigurationError(f"backoff jitter must be between 0 and 1, got {self.jitter!r}")

    def __call__(self, retry: int) -> float:
        if retry < 1:
            raise ConfigurationError(f"retry numbers start at 1, got {retry!r}")
        # Cap the exponent first: 2**retry for a huge retry would overflow a float.
        exponent = min(retry - 1, 64)
        delay = min(self.base * 2.0**exponent, self.max)
        if self.jitter:
            delay -= delay * self.jitter * random.random()
        return delay


def _number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _positive(value: object) -> bool:
    # Finite too: an infinite base or cap would make every delay infinite (or overflow timedelta).
    return _number(value) and math.isfinite(value) and value > 0


def as_policy(backoff: BackoffPolicy | None) -> BackoffPolicy:
    """The policy to use: the given callable, or the default exponential one.

    Raises:
        ConfigurationError: ``backoff`` is neither None nor callable.
    """
    if backoff is None:
        return ExponentialBackoff()
    if not callable(backoff):
        raise ConfigurationError(f"backoff must be a callable retry -> seconds, got {backoff!r}")
    return backoff


def delay_for(policy: BackoffPolicy, retry: int) -> timedelta:
    """The policy's delay before retry ``retry`` as a ``timedelta`` from 0 to ``MAX_DURATION``.

    Raises:
        ConfigurationError: the policy returned something that is not a finite, non-negative
            duration of at most ``MAX_DURATION`` (the message quotes it).
        Exception: whatever the policy itself raised.
    """
    value = policy(retry)
    try:
        return as_timedelta(value, what="the delay", maximum=MAX_DURATION)
    except ConfigurationError as exc:
        raise ConfigurationError(f"it returned {value!r:.40} for retry {retry}: {exc}") from None
