"""``outboxkit.cli.logs``: a driver's repeated lines let through once per window (the next one
counting those dropped), every message on one line, outboxkit's own lines untouched."""

from __future__ import annotations

import logging
import sys

from outboxkit.cli.logs import PrintableFormatter, RepeatFilter


class _Clock:
    def __init__(self) -> None:
        self.at = 0.0

    def __call__(self) -> float:
        return self.at


def _record(name: str, msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(name, logging.WARNING, __file__, 1, msg, args, None)


def test_a_drivers_repeats_pass_once_per_window_and_are_counted() -> None:
    clock = _Clock()
    repeats = RepeatFilter(window=60, clock=clock)
    first = _record("psycopg.pool", "error connecting in %r: %s", "p", "refused\n\tIs it up?")
    assert repeats.filter(first)
    assert first.getMessage() == (
        "error connecting in 'p': refused Is it up? "
        "(repeats of this are logged at most once per 60s)"
    )
    for _ in range(19):
        clock.at += 0.5
        assert not repeats.filter(_record("psycopg.pool", "error connecting in %r: %s", "p", "x"))
    other = _record("psycopg.pool", "discarding closed connection: %s", "c")
    assert repeats.filter(other)  # another kind: its own window
    clock.at += 60
    later = _record("psycopg.pool", "error connecting in %r: %s", "p", "refused")
    assert repeats.filter(later)
    assert later.getMessage().endswith("(19 more like it in the last 60s not logged)")


def test_outboxkits_own_lines_are_never_dropped() -> None:
    repeats = RepeatFilter(window=60, clock=_Clock())
    for _ in range(3):
        record = _record("outboxkit", "event %d failed", 1)
        assert repeats.filter(record) and record.getMessage() == "event 1 failed"


def test_a_message_is_one_line_and_a_traceback_keeps_its_lines() -> None:
    formatter = PrintableFormatter("%(levelname)s %(name)s: %(message)s")
    record = _record("outboxkit", "unavailable: %s", "closed\n\tThis probably means\x1b[31m")
    assert formatter.format(record) == (
        "WARNING outboxkit: unavailable: closed This probably means\\x1b[31m"
    )
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        failing = logging.LogRecord(
            "outboxkit", logging.ERROR, __file__, 1, "failed", None, sys.exc_info()
        )
    text = formatter.format(failing)
    assert text.startswith("ERROR outboxkit: failed\nTraceback (most recent call last):\n")
