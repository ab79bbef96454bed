"""Clocks for tests: ``FreezegunClock`` and ``TimeMachineClock``, ``FrozenClock``s that are
freezegun's frozen time and time-machine's travelled time.

freezegun and time-machine are not imported here: the pytest plugin hands in what it froze.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from ..clock import FrozenClock, as_timedelta, parse_instant

__all__ = ["FreezegunClock", "TimeMachineClock"]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class FreezegunClock(FrozenClock):
    """A ``FrozenClock`` that is freezegun's frozen time: app code calling ``datetime.now()`` or
    ``time.time()`` sees the same instant, and moving either (``advance``/``set`` here, or
    ``tick``/``move_to`` on freezegun's factory) moves both.

    Args:
        frozen: the factory ``freezegun.freeze_time(...)`` yields when entered.
    """

    def __init__(self, frozen: Any) -> None:
        super().__init__(
            frozen.time_to_freeze.replace(tzinfo=UTC)
            if frozen.time_to_freeze.tzinfo is None
            else frozen.time_to_freeze
        )
        self._frozen = frozen

    @property
    def freezer(self) -> Any:
        """freezegun's time factory (``tick``, ``move_to``) behind this clock."""
        return self._frozen

    def now(self) -> datetime:
        fake = self._frozen()  # freezegun's current (naive UTC) instant
        return datetime(
            fake.year,
            fake.month,
            fake.day,
            fake.hour,
            fake.minute,
            fake.second,
            fake.microsecond,
            tzinfo=UTC,
        )

    def advance(self, by: float | timedelta) -> datetime:
        """Move freezegun's time (and so this clock) forward; returns the new instant.

        Raises:
            ConfigurationError: ``by`` is negative or not a duration.
        """
        self._frozen.tick(as_timedelta(by, what="advance"))
        now = self.now()
        self._notify(now)
        return now

    def set(self, instant: datetime | str) -> datetime:
        """Move freezegun's time (and so this clock) to ``instant``; returns it.

        Raises:
            ConfigurationError: ``instant`` is naive or not a valid instant.
        """
        value = parse_instant(instant)
        self._frozen.move_to(value)
        self._notify(value)
        return value


class TimeMachineClock(FrozenClock):
    """A ``FrozenClock`` that is time-machine's travelled time (``time_machine.travel(...,
    tick=False)``): app code calling ``datetime.now()`` or ``time.time()`` sees the same
    instant, and moving either (``advance``/``set`` here, or ``shift``/``move_to`` on the
    traveller) moves both. time-machine leaves ``time.monotonic`` alone, so asyncio's timers
    keep running.

    Args:
        traveller: what ``time_machine.travel(...)`` yields when entered.
    """

    def __init__(self, traveller: Any) -> None:
        self._traveller = traveller
        super().__init__(self.now())

    @property
    def traveller(self) -> Any:
        """time-machine's traveller (``shift``, ``move_to``) behind this clock."""
        return self._traveller

    def now(self) -> datetime:
        return _EPOCH + timedelta(microseconds=self._traveller.time_ns() // 1000)

    def advance(self, by: float | timedelta) -> datetime:
        """Move time-machine's time (and so this clock) forward; returns the new instant.

        Raises:
            ConfigurationError: ``by`` is negative or not a duration.
        """
        self._traveller.shift(as_timedelta(by, what="advance"))
        now = self.now()
        self._notify(now)
        return now

    def set(self, instant: datetime | str) -> datetime:
        """Move time-machine's time (and so this clock) to ``instant``; returns it.

        Raises:
            ConfigurationError: ``instant`` is naive or not a valid instant.
        """
        value = parse_instant(instant)
        self._traveller.move_to(value)
        self._notify(value)
        return value
