"""What one drain did (``DrainReport``), and the handler exceptions it raises together
(``HandlerErrors``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

from ..core.model import Delivery, Event, Outcome, PollReport
from ..errors import DrainError
from .left import Left

__all__ = ["DrainReport", "HandlerErrors", "first_failure_line"]


def first_failure_line(delivery: Delivery) -> str:
    """One line naming a failed delivery: handler, event, attempt and error."""
    error = delivery.exception
    what = f"{type(error).__name__}: {error}" if error is not None else (delivery.error or "?")
    return (
        f"handler {delivery.handler!r} failed on event {delivery.event_id} "
        f"{delivery.topic!r} (attempt {delivery.attempt}): {what:.300}"
    )


@dataclass
class DrainReport:
    """Everything one drain did.

    Attributes:
        deliveries: every handler run, in order (event id, topic, handler, attempt, outcome,
            error, virtual time).
        published / retried / dead_lettered: event ids, in the order it happened (an event
            retried twice appears twice in ``retried``).
        rounds: how many rounds claimed something.
        pending: events still pending at the end (due after the last retry or lease the
            drain waited out, and past ``until``).
        advanced: how far the drain moved the clock.
        topics_per_round: the topics claimed in each round (the cascade, round by round).
        left: every event neither published nor dead-lettered at the end, with the reason it
            is still there (another topic, ``limit``, a retry not waited out, a key held ...).
        crashes: the crash points that struck (``crash_at=``), in order.
    """

    deliveries: list[Delivery] = field(default_factory=list)
    published: list[int] = field(default_factory=list)
    retried: list[int] = field(default_factory=list)
    dead_lettered: list[int] = field(default_factory=list)
    lease_lost: list[int] = field(default_factory=list)
    rounds: int = 0
    pending: list[Event] = field(default_factory=list)
    advanced: timedelta = timedelta(0)
    topics_per_round: list[list[str]] = field(default_factory=list)
    left: list[Left] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    _topics: dict[int, str] = field(default_factory=dict, repr=False)
    keys: dict[int, str | None] = field(default_factory=dict, repr=False)
    """Each event's key, by id (for ``assert_key_order``)."""

    @property
    def rejected(self) -> list[Delivery]:
        """The deliveries a handler rejected (``Reject``), in order."""
        return [d for d in self.deliveries if d.outcome is Outcome.REJECTED]

    @property
    def failed(self) -> list[Delivery]:
        """The deliveries whose handler raised (each one retried or dead-lettered), in order."""
        return [d for d in self.deliveries if d.outcome is Outcome.FAILED]

    def deliveries_to(self, topic: str | None = None, handler: str | None = None) -> list[Delivery]:
        """The deliveries matching ``topic`` and/or ``handler``.

        Args:
            topic: only deliveries of events of this topic (any topic when None).
            handler: only deliveries to the handler of this name (any handler when None).

        Returns:
            The matching deliveries, in order.
        """
        return [
            d
            for d in self.deliveries
            if (topic is None or d.topic == topic) and (handler is None or d.handler == handler)
        ]

    def add_round(self, report: PollReport, topics: Mapping[int, str]) -> None:
        """Fold one round's ``PollReport`` in (the drain calls it; ``topics`` names the
        topic of every event the round claimed)."""
        self._topics.update(topics)
        self.deliveries.extend(report.deliveries)
        self.published.extend(report.published)
        self.retried.extend(report.retried)
        self.dead_lettered.extend(report.dead_lettered)
        self.lease_lost.extend(report.lease_lost)

    # -- assertions -----------------------------------------------------------------------------

    def assert_delivered(
        self, topic: str, *, handler: str | None = None, count: int | None = None
    ) -> None:
        """Some event of ``topic`` was delivered with success (to ``handler``, ``count`` times).

        Args:
            topic: the event topic.
            handler: only deliveries to this handler count (any handler when None).
            count: exactly this many successful deliveries (at least one when None).

        Raises:
            AssertionError: with the report's summary.
        """
        __tracebackhide__ = True
        hits = [d for d in self.deliveries_to(topic, handler) if d.outcome is Outcome.SUCCEEDED]
        self._check(hits, count, f"delivered {topic!r}" + (f" to {handler!r}" if handler else ""))

    def assert_rejected(
        self, topic: str, *, handler: str | None = None, count: int | None = None
    ) -> None:
        """Some event of ``topic`` was rejected (by ``handler``), ``count`` times if given.

        Args:
            topic: the event topic.
            handler: only rejections by this handler count (any handler when None).
            count: exactly this many rejections (at least one when None).

        Raises:
            AssertionError: with the report's summary.
        """
        __tracebackhide__ = True
        hits = [d for d in self.deliveries_to(topic, handler) if d.outcome is Outcome.REJECTED]
        self._check(hits, count, f"rejected {topic!r}" + (f" by {handler!r}" if handler else ""))

    def assert_dead_lettered(self, topic: str, *, count: int | None = None) -> None:
        """Some event of ``topic`` was dead-lettered, ``count`` times if given.

        Args:
            topic: the event topic.
            count: exactly this many dead-lettered events (at least one when None).

        Raises:
            AssertionError: with the report's summary.
        """
        __tracebackhide__ = True
        hits = [i for i in self.dead_lettered if self._topics.get(i) == topic]
        self._check(hits, count, f"dead-lettered {topic!r}")

    def assert_key_order(self) -> None:
        """Each key's events were delivered with success in the order they were enqueued
        (their ids), each one's first success after the one before it had settled.

        Raises:
            AssertionError: naming the key and the two events out of order.
        """
        __tracebackhide__ = True
        keys = self.keys
        last: dict[str, int] = {}
        for d in self.deliveries:
            key = keys.get(d.event_id)
            if key is None or d.outcome is not Outcome.SUCCEEDED:
                continue
            before = last.get(key)
            if before is not None and d.event_id < before:
                raise AssertionError(
                    f"key {key!r}: event {d.event_id} was delivered after event {before}, "
                    f"which was enqueued later\n{self.summary()}"
                )
            last[key] = max(d.event_id, before or 0)

    def assert_no_duplicates(self, *, handler: str | None = None) -> None:
        """No handler (or ``handler``) succeeded twice for one event in this drain (a crash
        point or a stale poller makes a handler run again: its effect must not count twice).

        Raises:
            AssertionError: naming the handler, the event and how many times.
        """
        __tracebackhide__ = True
        seen: dict[tuple[str, int], int] = {}
        for d in self.deliveries_to(handler=handler):
            if d.outcome is Outcome.SUCCEEDED:
                seen[(d.handler, d.event_id)] = seen.get((d.handler, d.event_id), 0) + 1
        twice = [(h, e, n) for (h, e), n in seen.items() if n > 1]
        if twice:
            h, e, n = twice[0]
            raise AssertionError(
                f"handler {h!r} succeeded {n} times for event {e}\n{self.summary()}"
            )

    def _check(self, hits: Sequence[object], count: int | None, what: str) -> None:
        __tracebackhide__ = True
        if (count is None and not hits) or (count is not None and len(hits) != count):
            expected = "at least once" if count is None else f"{count} time(s)"
            raise AssertionError(f"expected {what} {expected}, found {len(hits)}\n{self.summary()}")

    def summary(self) -> str:
        """A few lines a human reads in a failing test.

        Returns:
            The counts, the first 50 deliveries and the first 20 events still pending.
        """
        lines = [
            f"DrainReport: {self.rounds} round(s), {len(self.deliveries)} deliveries, "
            f"{len(self.published)} published, {len(self.retried)} retried, "
            f"{len(self.dead_lettered)} dead-lettered, {len(self.left)} left, "
            f"clock advanced {self.advanced.total_seconds():g}s"
        ]
        for d in self.deliveries[:50]:
            error = f" ({d.error})" if d.error else ""
            lines.append(
                f"  event {d.event_id} {d.topic!r} -> {d.handler}: {d.outcome.value} "
                f"on attempt {d.attempt} at {d.at.isoformat()}{error}"
            )
        if len(self.deliveries) > 50:
            lines.append(f"  ... {len(self.deliveries) - 50} more")
        for left in self.left[:20]:
            lines.append(f"  left: {left}")
        for crash in self.crashes[:20]:
            lines.append(f"  crash point: {crash}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


class HandlerErrors(DrainError, ExceptionGroup):  # type: ignore[misc,unused-ignore]
    """Unexpected handler exceptions from one drain, raised together once it finished.

    ``report`` is the full ``DrainReport``; the group's exceptions are the handlers' own.

    Args:
        message: the group's message (the drain puts the report's summary in it).
        exceptions: the handlers' exceptions, in the order they were raised.
        report: what the drain did, every outcome included.
    """

    report: DrainReport

    def __new__(
        cls, message: str, exceptions: Sequence[Exception], report: DrainReport
    ) -> HandlerErrors:
        self = super().__new__(cls, message, exceptions)
        self.report = report
        return self

    def __init__(self, message: str, exceptions: Sequence[Exception], report: DrainReport) -> None:
        super().__init__(message, exceptions)

    def derive(self, excs: Sequence[Exception]) -> HandlerErrors:  # type: ignore[override]
        # ``split``/``subgroup`` build their parts through ``derive``: keep the report on them.
        return HandlerErrors(self.message, excs, self.report)
