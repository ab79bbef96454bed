"""``DrainProgress`` on its own: a rate over a window, an ETA, a total that says it grows, and
a last line read after the drain (the true counts, kept). Time is an injected clock."""

from __future__ import annotations

import io
from dataclasses import dataclass, field

from outboxkit.cli.progress import CLEAR, DrainProgress, StatusLine
from outboxkit.core.model import Stats


@dataclass
class _Counts:
    """A stand-in for ``Outbox``: ``stats()`` answers the counts the test sets."""

    stats_now: Stats = field(default_factory=Stats)

    def stats(self) -> Stats:
        return self.stats_now


@dataclass
class _Clock:
    at: float = 100.0

    def __call__(self) -> float:
        return self.at


def _progress() -> tuple[DrainProgress, _Counts, _Clock, io.StringIO]:
    counts, clock, stream = _Counts(Stats(pending=100)), _Clock(), io.StringIO()
    progress = DrainProgress(
        counts,  # type: ignore[arg-type]  # only stats() is read
        StatusLine(stream, live=True),
        clock=clock,
    )
    return progress, counts, clock, stream


def _shown(stream: io.StringIO) -> str:
    return stream.getvalue().rsplit(CLEAR, 1)[-1]


def test_rate_and_eta_over_the_window() -> None:
    progress, counts, clock, stream = _progress()
    progress.maybe_show()
    assert _shown(stream).startswith(f"draining [{'-' * 24}] 0/100 (0.0/s, ETA -, ")
    clock.at += 2
    counts.stats_now = Stats(pending=60, published=40)
    progress.maybe_show()
    line = _shown(stream)
    assert " 40/100 (20.0/s, ETA 3.0s, 0 dead-lettered)" in line, line


def test_a_total_that_grows_says_so() -> None:
    progress, counts, clock, stream = _progress()
    progress.maybe_show()
    clock.at += 1
    counts.stats_now = Stats(pending=80, published=50)  # 30 follow-ups enqueued meanwhile
    progress.maybe_show()
    line = _shown(stream)
    assert " 50/130+ (" in line and "total growing: handlers enqueue follow-ups" in line, line


def test_the_last_line_is_read_after_the_drain_and_kept() -> None:
    progress, counts, clock, stream = _progress()
    progress.maybe_show()
    clock.at += 0.1
    counts.stats_now = Stats(pending=90, published=10)
    progress.maybe_show()  # the last draw during the drain: stale by its end
    clock.at += 3.9
    counts.stats_now = Stats(published=98, dead=2)
    progress.finish()
    output = stream.getvalue()
    kept = output.rstrip("\n").rsplit(CLEAR, 1)[-1]
    assert kept == f"drained [{'#' * 24}] 100/100 (in 4.0s, 25.0/s, 2 dead-lettered)", output
    assert output.endswith("\n")  # a line of its own, the status erased
