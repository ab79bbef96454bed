"""The log of ``outboxkit run``: one handler and one format for every line, outboxkit's and
the drivers' (``psycopg``, whose ``psycopg.pool`` reports its connection attempts), on stderr
above the status line.

A driver repeats itself through an outage: psycopg_pool logs every failed connection attempt
(20 lines in a 10 s outage, each several lines long). :class:`RepeatFilter` lets the first of a
kind through, on one line, and drops the same kind for ``window`` seconds; the next one through
says how many were dropped. The first line names the real cause (libpq's: "Connection
refused", a bad password...), which is what an operator needs.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..core.text import printable
from .progress import StatusLine, StatusLineHandler

__all__ = ["DRIVER_LOGGERS", "LOG_FORMAT", "PrintableFormatter", "RepeatFilter", "command_logging"]

LOG_FORMAT = "%(asctime)s %(levelname)s {who}%(name)s: %(message)s"
DRIVER_LOGGERS = ("psycopg",)
"""Loggers of the drivers, written through the same handler (warnings and above; everything
with ``--log-level DEBUG``)."""
REPEAT_WINDOW = 60.0  # seconds a driver's line of one kind is logged at most once in


class PrintableFormatter(logging.Formatter):
    """Log lines carry handlers' error texts and topics: no control character reaches the
    terminal through them. A message is one line (libpq's span several: a line break and its
    indent become a space); a traceback after it keeps its line breaks."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = _one_line(record.message)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record), newlines=True)


class RepeatFilter(logging.Filter):
    """A driver's records: each on one line, and one of a kind (logger and message template)
    per ``window`` seconds; the next one says how many were dropped.

    Args:
        window: seconds.
        clock: monotonic seconds (injected in tests).
    """

    def __init__(
        self, window: float = REPEAT_WINDOW, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.window = window
        self.clock = clock
        self._last: dict[tuple[str, object], float] = {}
        self._dropped: dict[tuple[str, object], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(DRIVER_LOGGERS):
            return True
        kind = (record.name, record.msg)
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.window:
            self._dropped[kind] = self._dropped.get(kind, 0) + 1
            return False
        self._last[kind] = now
        message = " ".join(record.getMessage().split())
        dropped = self._dropped.pop(kind, 0)
        if dropped:
            message += f" ({dropped} more like it in the last {self.window:g}s not logged)"
        elif last is None:
            message += f" (repeats of this are logged at most once per {self.window:g}s)"
        record.msg, record.args = message, None
        return True


def _one_line(text: str) -> str:
    if "\n" not in text and "\r" not in text:
        return text
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


@contextmanager
def command_logging(level: str, who: str) -> Iterator[StatusLine]:
    """Log outboxkit's records, and the drivers' warnings (all of them at DEBUG), to stderr
    for the duration of the command, above the status line (drawn on a terminal only) it
    yields; a driver's repeats filtered (:class:`RepeatFilter`)."""
    status = StatusLine(sys.stderr)
    handler = StatusLineHandler(status)
    handler.setFormatter(PrintableFormatter(LOG_FORMAT.format(who=who)))
    handler.addFilter(RepeatFilter())
    levels = {"outboxkit": level}
    levels.update((name, "DEBUG" if level == "DEBUG" else "WARNING") for name in DRIVER_LOGGERS)
    previous: dict[str, tuple[int, bool]] = {}
    for name, wanted in levels.items():
        logger = logging.getLogger(name)
        previous[name] = (logger.level, logger.propagate)
        logger.addHandler(handler)
        logger.setLevel(wanted)
    # A driver's records go through our handler only: the app's root handlers (or Python's
    # last resort, which writes bare messages) would print them a second time, unformatted.
    for name in DRIVER_LOGGERS:
        logging.getLogger(name).propagate = False
    try:
        yield status
    finally:
        status.clear()
        for name, (old_level, propagate) in previous.items():
            logger = logging.getLogger(name)
            logger.removeHandler(handler)
            logger.setLevel(old_level)
            logger.propagate = propagate
