"""``outboxkit run --until-idle``'s progress: one status line at the bottom of a terminal, kept
apart from the log lines written above it.

:class:`StatusLine` owns the terminal's last line: a log line (the command's own, or a child
poller's, relayed by the supervisor) first clears it, is written, and the status is drawn again
under it, so the two never share a line. On a stream that is not a terminal (a file, a pipe,
a CI log) nothing is drawn: only the log lines are written.

:class:`DrainProgress` says how far a drain has come, read from the store (``outbox.stats()``)
so that it counts the whole group's work, whichever process did it, and the follow-up events
handlers enqueue.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TextIO

from ..core.text import printable

if TYPE_CHECKING:
    from ..outbox import Outbox

__all__ = ["DrainProgress", "StatusLine", "StatusLineHandler"]

CLEAR = "\r\x1b[K"  # to the line's start, and erase it
_BAR = 24


class StatusLine:
    """One line of status under the log lines (see the module docstring).

    Args:
        stream: where both go (stderr).
        live: draw the status (default: whether ``stream`` is a terminal).
    """

    def __init__(self, stream: TextIO, *, live: bool | None = None) -> None:
        self.stream = stream
        if live is None:
            isatty = getattr(stream, "isatty", None)
            live = bool(isatty()) if callable(isatty) else False
        self.live = live
        self._text = ""
        self._lock = threading.Lock()

    def show(self, text: str) -> None:
        """Draw ``text`` (one line) as the status, replacing the last."""
        if not self.live:
            return
        with self._lock:
            self._text = printable(text)
            self.stream.write(CLEAR + self._text)
            self.stream.flush()

    def write(self, text: str) -> None:
        """Write ``text`` (whole lines, ending with a line break) above the status."""
        with self._lock:
            if self.live and self._text:
                self.stream.write(CLEAR + text + self._text)
            else:
                self.stream.write(text)
            self.stream.flush()

    def clear(self) -> None:
        """Erase the status (the log lines stay)."""
        with self._lock:
            if self.live and self._text:
                self.stream.write(CLEAR)
                self.stream.flush()
            self._text = ""


class StatusLineHandler(logging.Handler):
    """A logging handler writing its records through a :class:`StatusLine`."""

    def __init__(self, status: StatusLine) -> None:
        super().__init__()
        self.status = status

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.status.write(self.format(record) + "\n")
        except Exception:
            self.handleError(record)


@dataclass
class DrainProgress:
    """How far a drain has come, from the store's counts, drawn on a :class:`StatusLine` at
    most every ``every`` seconds.

    Done: the events published or dead-lettered since the start; left: those neither published
    nor dead (due, leased, or waiting for a retry that may come after the drain ends).
    """

    outbox: Outbox
    status: StatusLine
    every: float = 0.25
    _published: int = 0
    _dead: int = 0
    _next_at: float = field(default=0.0)

    def __post_init__(self) -> None:
        if self.status.live:
            stats = self.outbox.stats()
            self._published, self._dead = stats.published, stats.dead

    def maybe_show(self) -> None:
        """Read the counts and draw them, unless that was done less than ``every`` ago (or
        the status is not drawn at all)."""
        now = time.monotonic()
        if not self.status.live or now < self._next_at:
            return
        self._next_at = now + self.every
        try:
            stats = self.outbox.stats()
        except Exception:  # an outage: the pollers report it; the status waits
            return
        dead = stats.dead - self._dead
        done = stats.published - self._published + dead
        left = stats.pending + stats.claimed
        total = max(done + left, 1)
        filled = round(_BAR * done / total)
        self.status.show(
            f"draining [{'#' * filled}{'-' * (_BAR - filled)}] {done}/{done + left} "
            f"({dead} dead-lettered)"
        )
