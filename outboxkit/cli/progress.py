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
from collections import deque
from collections.abc import Callable
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
    most every ``every`` seconds; :meth:`finish` reads them once more and leaves the true last
    line above the log's end.

    Done: the events published or dead-lettered since the start; left: those neither published
    nor dead (due, leased, or waiting for a retry that may come after the drain ends). The total
    (done + left) grows when handlers enqueue follow-ups: it is then shown with a ``+`` and
    "growing". The rate is over the last ``window`` seconds; the ETA is what is left at it.
    """

    outbox: Outbox
    status: StatusLine
    every: float = 0.25
    window: float = 10.0
    clock: Callable[[], float] = time.monotonic
    _published: int = 0
    _dead: int = 0
    _next_at: float = field(default=0.0)
    _started_at: float = 0.0
    _first_total: int | None = None
    _grown: bool = False
    _samples: deque[tuple[float, int]] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self._started_at = self.clock()
        if self.status.live:
            stats = self.outbox.stats()
            self._published, self._dead = stats.published, stats.dead

    def maybe_show(self) -> None:
        """Read the counts and draw them, unless that was done less than ``every`` ago (or
        the status is not drawn at all)."""
        now = self.clock()
        if not self.status.live or now < self._next_at:
            return
        self._next_at = now + self.every
        line = self._read(now, final=False)
        if line is not None:
            self.status.show(line)

    def finish(self) -> None:
        """The drain ended: read the counts once more and write them as a line of their own
        (kept on the terminal, where the status line is erased)."""
        if not self.status.live:
            return
        line = self._read(self.clock(), final=True)
        self.status.clear()
        if line is not None:
            self.status.write(line + "\n")

    def _read(self, now: float, *, final: bool) -> str | None:
        try:
            stats = self.outbox.stats()
        except Exception:  # an outage: the pollers report it; the status waits
            return None
        dead = stats.dead - self._dead
        done = stats.published - self._published + dead
        left = stats.pending + stats.claimed
        total = done + left
        if self._first_total is None:
            self._first_total = total
        elif total > self._first_total:
            self._grown = True
        self._samples.append((now, done))
        while len(self._samples) > 2 and now - self._samples[0][0] > self.window:
            self._samples.popleft()
        rate = self._rate(now, done, final=final)
        filled = round(_BAR * done / max(total, 1))
        bar = f"[{'#' * filled}{'-' * (_BAR - filled)}]"
        of = f"{done}/{total}{'+' if self._grown and not final else ''}"
        parts = [f"{rate:.1f}/s"]
        if final:
            parts.insert(0, f"in {_clock_text(now - self._started_at)}")
        elif left and rate > 0:
            parts.append(f"ETA {_clock_text(left / rate)}")
        elif left:
            parts.append("ETA -")
        if self._grown and not final:
            parts.append("total growing: handlers enqueue follow-ups")
        parts.append(f"{dead} dead-lettered")
        if final and left:
            parts.append(f"{left} left (retries later, or other pollers' leases)")
        word = "drained" if final else "draining"
        return f"{word} {bar} {of} ({', '.join(parts)})"

    def _rate(self, now: float, done: int, *, final: bool) -> float:
        if final:  # the whole drain's
            elapsed = now - self._started_at
            return done / elapsed if elapsed > 0 else 0.0
        since, then = self._samples[0]
        elapsed = now - since
        return (done - then) / elapsed if elapsed > 0 else 0.0


def _clock_text(seconds: float) -> str:
    """``1:02:03``, ``2:03`` or ``4.2s``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
