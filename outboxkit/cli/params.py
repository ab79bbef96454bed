"""What the command line reads besides plain names: whole numbers and event ids (ASCII digits
only), durations (``30d``, ``500ms``), instants (a duration back from now, or ISO-8601), and
store options (``KEY=VALUE``).

The click parameter types turn a bad value into a usage error (one line, exit code 2).
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta
from typing import Any

import click

from ..clock import parse_instant
from ..core.text import parse_decimal
from ..errors import ConfigurationError

__all__ = [
    "DURATION",
    "DURATION_HELP",
    "EVENT_ID",
    "Duration",
    "EventId",
    "Since",
    "StoreOption",
    "Whole",
    "format_duration",
    "parse_duration",
]

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION_RE = re.compile(r"^(\d+(?:\.\d+)?|\.\d+)(ms|s|m|h|d|w)?$")
_EXACT_UNITS = (  # microseconds per unit, largest first: format_duration picks the first exact one
    ("d", 86_400_000_000),
    ("h", 3_600_000_000),
    ("m", 60_000_000),
    ("s", 1_000_000),
    ("ms", 1_000),
)
DURATION_HELP = "use e.g. 30d, 12h, 15m, 10s or 500ms; a bare number is seconds"


def parse_duration(text: str) -> timedelta:
    """``"30d"``, ``"12h"``, ``"15m"``, ``"10s"``, ``"500ms"`` (or ``"1.5"`` seconds) as a timedelta.

    Args:
        text: the duration as typed; case and surrounding blanks do not matter.

    Returns:
        The duration (never negative).

    Raises:
        ConfigurationError: (a ``ValueError``) not such a duration (negative ones are not), or
            too long for a timedelta.
    """
    match = _DURATION_RE.match(text.strip().lower()) if isinstance(text, str) else None
    if match is None:
        raise ConfigurationError(f"{text!r} is not a duration: {DURATION_HELP}")
    number, unit = match.groups()
    try:
        return timedelta(seconds=float(number) * _UNITS[unit or "s"])
    except OverflowError:
        raise ConfigurationError(f"{text!r} is too long a duration") from None


def format_duration(delta: timedelta) -> str:
    """A duration as :func:`parse_duration` reads it back, in the largest exact unit.

    Args:
        delta: a non-negative duration.

    Returns:
        ``"7d"``, ``"90s"``, ``"500ms"``; a duration that is no whole number of milliseconds
        as fractional milliseconds (``"0.250ms"``).
    """
    micros = delta // timedelta(microseconds=1)
    if micros == 0:
        return "0s"
    for unit, size in _EXACT_UNITS:
        if micros % size == 0:
            return f"{micros // size}{unit}"
    return f"{micros / 1000:.3f}ms"


class Whole(click.IntRange):
    """A whole number in a range (click's ``IntRange``), written in ASCII digits only: ``int``
    (which click calls) also takes blanks, underscores, signs and other scripts' digits
    (``"١٢"`` is 12 to it).

    Args:
        min: the smallest number taken (>= 0), or None for 0.
        max: the largest number taken, or None for no bound.
    """

    name = "integer"

    def __init__(self, min: int | None = None, max: int | None = None) -> None:
        super().__init__(min=0 if min is None else min, max=max)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return super().convert(value, param, ctx)
        text = str(value)
        # 4,300 digits: the most int() reads (its own error past that).
        if not (text.isascii() and text.isdigit() and len(text) <= 4300):
            self.fail(f"{text[:40]!r} is not a whole number (ASCII digits 0-9)", param, ctx)
        return super().convert(int(text), param, ctx)


class EventId(click.ParamType):  # type: ignore[type-arg,unused-ignore]
    """An event id: ASCII digits, 1 to 2**63 - 1 (``parse_decimal``)."""

    name = "id"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and 1 <= value < 2**63:
            return value
        event_id = parse_decimal(str(value), minimum=1, maximum=2**63 - 1)
        if event_id is None:
            self.fail(
                f"{str(value)[:40]!r} is not an event id: a number from 1 to 2**63 - 1, "
                "in ASCII digits",
                param,
                ctx,
            )
        return event_id


class Duration(click.ParamType):  # type: ignore[type-arg,unused-ignore]
    """A duration, read by :func:`parse_duration`."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, timedelta):
            return value
        try:
            return parse_duration(str(value))
        except ConfigurationError as exc:
            self.fail(str(exc), param, ctx)


class Since(click.ParamType):  # type: ignore[type-arg,unused-ignore]
    """A duration back from now (``1h``) or an ISO-8601 instant (``2030-01-01T00:00:00Z``)."""

    name = "since"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, timedelta | datetime):
            return value
        try:
            return parse_duration(str(value))
        except ConfigurationError:
            pass
        try:
            return parse_instant(str(value))
        except ValueError:
            self.fail(
                f"{value!r} is neither a duration nor an ISO-8601 instant with a time zone: "
                f"{DURATION_HELP}, or e.g. 2030-01-31T12:00:00Z",
                param,
                ctx,
            )


class StoreOption(click.ParamType):  # type: ignore[type-arg,unused-ignore]
    """``KEY=VALUE``; the value is read as JSON when it parses (``5``, ``true``), else a string."""

    name = "key=value"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, tuple):
            return value
        key, sep, raw = str(value).partition("=")
        if not sep or not key.strip():
            self.fail(f"{value!r} is not KEY=VALUE", param, ctx)
        try:
            parsed: Any = json.loads(raw)
        except ValueError:
            parsed = raw
        return (key.strip(), parsed)


DURATION = Duration()
EVENT_ID = EventId()
