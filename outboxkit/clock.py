"""Clocks. One per outbox, injected; the pure core never reads one.

``SystemClock`` is the production clock. ``FrozenClock`` is the test clock: it stands still until
told to move, so retries, leases and delays are driven by the test, never by sleeping.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Protocol, runtime_checkable

from .core.duration import as_timedelta
from .errors import ConfigurationError

__all__ = [
    "Clock",
    "FrozenClock",
    "MonotonicClock",
    "SystemClock",
    "as_timedelta",
    "parse_instant",
    "require_aware",
]


@runtime_checkable
class Clock(Protocol):
    """Anything with ``now() -> aware datetime``."""

    def now(self) -> datetime: ...


class SystemClock:
    """The wall clock, in UTC."""

    def now(self) -> datetime:
        return datetime.now(UTC)

    def __repr__(self) -> str:
        return "SystemClock()"


class MonotonicClock:
    """A clock for local deadlines only: it never steps when the host's wall clock is set, and
    its instants mean nothing outside this process (they count from an arbitrary origin).

    A poller keeps its own lease deadlines on it in production, so a clock step (NTP, a VM
    resumed, an operator's ``date -s``) can neither make it believe a lease it lost is still
    its own, nor give up one it holds.
    """

    _ORIGIN = datetime(2000, 1, 1, tzinfo=UTC)

    def now(self) -> datetime:
        return self._ORIGIN + timedelta(0, time.monotonic())  # positional: half the cost

    def __repr__(self) -> str:
        return "MonotonicClock()"


class FrozenClock:
    """A clock that only moves when told to. Thread-safe.

    Args:
        start: the first instant (aware datetime or ISO-8601 string); default 2030-01-01 UTC.

    Raises:
        ConfigurationError: ``start`` is naive or not a valid instant.
    """

    def __init__(self, start: datetime | str | None = None) -> None:
        self._lock = threading.Lock()
        self._now = parse_instant(start) if start is not None else datetime(2030, 1, 1, tzinfo=UTC)
        self._listeners: list[Callable[[datetime], None]] = []

    def now(self) -> datetime:
        with self._lock:
            return self._now

    def advance(self, by: float | timedelta) -> datetime:
        """Move forward by seconds or a timedelta; returns the new instant.

        Raises:
            ConfigurationError: ``by`` is negative or not a duration.
        """
        delta = as_timedelta(by, what="advance")
        with self._lock:
            self._now += delta
            now = self._now
        self._notify(now)
        return now

    def set(self, instant: datetime | str) -> datetime:
        """Jump to ``instant`` (forwards or backwards); returns it.

        Raises:
            ConfigurationError: ``instant`` is naive or not a valid instant.
        """
        value = parse_instant(instant)
        with self._lock:
            self._now = value
        self._notify(value)
        return value

    def on_change(self, listener: Callable[[datetime], None]) -> Callable[[], None]:
        """Call ``listener(now)`` after every move; returns a function that unsubscribes it."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def _notify(self, now: datetime) -> None:
        for listener in list(self._listeners):
            listener(now)

    def __repr__(self) -> str:
        return f"FrozenClock({self.now().isoformat()!r})"


def require_aware(value: object, what: str) -> datetime:
    """``value`` if it is a timezone-aware datetime.

    Raises:
        ConfigurationError: naming ``what``: naive, or not a datetime at all.
    """
    if not isinstance(value, datetime):
        raise ConfigurationError(f"{what} must be a datetime, got {value!r}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ConfigurationError(
            f"{what} must be timezone-aware (naive datetimes are refused), got {value!r}"
        )
    return value


def parse_instant(value: datetime | str) -> datetime:
    """An aware UTC datetime from a datetime or an ISO-8601 string (``Z`` allowed).

    Raises:
        ConfigurationError: naive, unparsable, or neither a datetime nor a string.
    """
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
        except ValueError:
            raise ConfigurationError(f"not an ISO-8601 instant: {value!r:.80}") from None
    elif isinstance(value, datetime):
        parsed = value
    else:
        raise ConfigurationError(f"an instant must be a datetime or ISO-8601 string, got {value!r}")
    if parsed.tzinfo is None or parsed.utcoffset() is None:
        raise ConfigurationError(f"an instant must carry a time zone (e.g. 'Z'), got {value!r}")
    return parsed.astimezone(UTC)
