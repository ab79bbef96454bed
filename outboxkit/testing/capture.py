"""The enqueue assertions (``assert_enqueued``, ``refute_enqueued``) and ``Capture``, which
applies them to what one ``with drain.capture()`` block enqueued.

Every assertion says in its message which events it looked at (its window): the drain's, every
event of the test store (committed, or seen through ``conn=`` inside the app's transaction); a
capture's, those enqueued inside its block.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any

from ..core.model import Event
from .matching import UNSET, EventFilter, Matcher

__all__ = ["Capture", "assert_enqueued", "refute_enqueued"]


class Capture:
    """The events enqueued since the block began (``with drain.capture() as cap``).

    Args:
        events: every event of the test store, through a connection when one is given.
        asserted: the ids ``assert_enqueued`` matched, for the drain's strict mode.
        now: the test clock's instant (for ``scheduled=`` durations).
        conn: the app's connection the block's bounds are read through (and its events, by
            default), when its transaction is open across the block.
    """

    def __init__(
        self,
        events: Callable[[Any], list[Event]],
        asserted: set[int],
        now: Callable[[], datetime],
        conn: Any = None,
    ) -> None:
        self._read = events
        self._asserted = asserted
        self._now = now
        self._conn = conn
        self._after = _last_id(events(conn))
        self._until: int | None = None

    def close(self) -> None:
        """The block ended: what is enqueued after it is not the block's."""
        self._until = _last_id(self._read(self._conn))

    def enqueued(self, topic: str | None = None, *, conn: Any = None) -> list[Event]:
        """The block's events (so far, while it is open), optionally of one topic.

        Args:
            topic: only events of this topic (all when None).
            conn: read through the app's connection, inside its open transaction (default:
                the one the capture was given).

        Returns:
            The events, in enqueue order.
        """
        return [
            e
            for e in self._read(conn if conn is not None else self._conn)
            if e.id > self._after
            and (self._until is None or e.id <= self._until)
            and (topic is None or e.topic == topic)
        ]

    @property
    def events(self) -> list[Event]:
        """The events enqueued inside the block, any state."""
        return self.enqueued()

    def assert_enqueued(
        self,
        topic: str,
        payload: Any = None,
        count: int | None = None,
        *,
        key: Any = UNSET,
        headers: Mapping[str, Any] | None = None,
        scheduled: datetime | timedelta | Matcher | None = None,
        conn: Any = None,
    ) -> list[Event]:
        """As ``Drain.assert_enqueued``, among the block's events."""
        __tracebackhide__ = True
        wanted = EventFilter(topic, payload, key, headers, scheduled, self._now())
        window = "enqueued inside the capture block"
        return assert_enqueued(
            self.enqueued(topic, conn=conn), wanted, count, window, asserted=self._asserted
        )

    def refute_enqueued(
        self,
        topic: str,
        payload: Any = None,
        *,
        key: Any = UNSET,
        headers: Mapping[str, Any] | None = None,
        scheduled: datetime | timedelta | Matcher | None = None,
        conn: Any = None,
    ) -> None:
        """As ``Drain.refute_enqueued``, among the block's events."""
        __tracebackhide__ = True
        wanted = EventFilter(topic, payload, key, headers, scheduled, self._now())
        refute_enqueued(
            self.enqueued(topic, conn=conn), wanted, "enqueued inside the capture block"
        )


def _last_id(events: list[Event]) -> int:
    return events[-1].id if events else 0


def assert_enqueued(
    candidates: list[Event],
    wanted: EventFilter,
    count: int | None,
    window: str,
    *,
    asserted: set[int],
    note: str = "",
) -> list[Event]:
    """Some (or exactly ``count``) of ``candidates`` that match ``wanted``.

    Args:
        candidates: the events of ``wanted.topic`` to look among.
        wanted: what a match is.
        count: exactly this many matches (at least one when None).
        window: which events ``candidates`` are, for the message.
        asserted: the ids of the matches are added to it, even when the count is wrong (a
            strict drain then reports only the assertion, not the events as unaccounted).
        note: a line added to the message (an enqueue that went to another database).

    Returns:
        The matching events.

    Raises:
        AssertionError: listing the candidates, each with where it first differs.
    """
    __tracebackhide__ = True
    hits = [e for e in candidates if wanted.mismatch(e) is None]
    asserted.update(e.id for e in hits)
    if (count is None and not hits) or (count is not None and len(hits) != count):
        expected = "at least one" if count is None else str(count)
        seen = "\n".join(_line(e, wanted) for e in candidates[:20])
        raise AssertionError(
            f"expected {expected} {wanted.topic!r} event(s){wanted.describe()}, found {len(hits)} among the "
            f"{len(candidates)} {wanted.topic!r} event(s) {window}:\n{seen or '  (none)'}"
            + (f"\n{note}" if note else "")
        )
    return hits


def refute_enqueued(candidates: list[Event], wanted: EventFilter, window: str) -> None:
    """None of ``candidates`` matches ``wanted``.

    Raises:
        AssertionError: listing the candidates that match.
    """
    __tracebackhide__ = True
    hits = [e for e in candidates if wanted.mismatch(e) is None]
    if hits:
        shown = "\n".join(f"  event {e.id}: {e.payload!r:.200}" for e in hits[:20])
        raise AssertionError(
            f"expected no {wanted.topic!r} event{wanted.describe()}, found {len(hits)} among the events "
            f"{window}:\n{shown}"
        )


def _line(event: Event, wanted: EventFilter) -> str:
    why = wanted.mismatch(event)
    return f"  event {event.id} {event.topic!r}: {event.payload!r:.200}" + (
        f"  <- {why}" if why else ""
    )
