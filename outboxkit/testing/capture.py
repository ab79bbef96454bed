"""The enqueue assertions (``assert_enqueued``, ``refute_enqueued``) and ``Capture``, which
applies them to what one ``with drain.capture()`` block enqueued."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..core.model import Event

__all__ = ["Capture", "assert_enqueued", "refute_enqueued"]


class Capture:
    """The events enqueued since the block began (``with drain.capture() as cap``).

    Args:
        last_id: the store's newest event id now (the block's start, and its end).
        events_after: the events with an id above the one given, any state.
        asserted: the ids ``assert_enqueued`` matched, for the drain's strict mode.
    """

    def __init__(
        self,
        last_id: Callable[[], int],
        events_after: Callable[[int], list[Event]],
        asserted: set[int],
    ) -> None:
        self._last_id = last_id
        self._events_after = events_after
        self._asserted = asserted
        self._after = last_id()
        self._until: int | None = None

    def close(self) -> None:
        """The block ended: what is enqueued after it is not the block's."""
        self._until = self._last_id()

    @property
    def events(self) -> list[Event]:
        """The events enqueued inside the block (so far, while it is open), any state."""
        events = self._events_after(self._after)
        return [e for e in events if self._until is None or e.id <= self._until]

    def enqueued(self, topic: str | None = None) -> list[Event]:
        """The block's events, optionally of one topic.

        Args:
            topic: only events of this topic (all when None).

        Returns:
            The events, in enqueue order.
        """
        return [e for e in self.events if topic is None or e.topic == topic]

    def assert_enqueued(
        self, topic: str, payload: Mapping[str, Any] | None = None, count: int | None = None
    ) -> list[Event]:
        """Some (or exactly ``count``) ``topic`` events of the block whose payload contains
        ``payload``'s items.

        Args:
            topic: the event topic.
            payload: a partial payload every match contains (any payload when None).
            count: exactly this many matches (at least one when None).

        Returns:
            The matching events.

        Raises:
            AssertionError: listing the block's events of that topic.
        """
        return assert_enqueued(self.enqueued(topic), topic, payload, count, asserted=self._asserted)

    def refute_enqueued(self, topic: str, payload: Mapping[str, Any] | None = None) -> None:
        """No ``topic`` event (whose payload contains ``payload``'s items) in the block.

        Args:
            topic: the event topic.
            payload: a partial payload (any payload when None).

        Raises:
            AssertionError: listing the events that match.
        """
        refute_enqueued(self.enqueued(topic), topic, payload)


def matches(payload: Any, partial: Mapping[str, Any] | None) -> bool:
    """``payload`` holds every item of ``partial`` (any payload does when ``partial`` is None)."""
    if partial is None:
        return True
    if not isinstance(payload, Mapping):
        return False
    return all(k in payload and payload[k] == v for k, v in partial.items())


def assert_enqueued(
    candidates: list[Event],
    topic: str,
    payload: Mapping[str, Any] | None,
    count: int | None,
    *,
    asserted: set[int],
) -> list[Event]:
    """Some (or exactly ``count``) of ``candidates`` whose payload contains ``payload``'s items.

    Args:
        candidates: the ``topic`` events to look among.
        topic: their topic (for the message).
        payload: a partial payload every match contains (any payload when None).
        count: exactly this many matches (at least one when None).
        asserted: the ids of the matches are added to it, even when the count is wrong (a
            strict drain then reports only the assertion, not the events as unaccounted).

    Returns:
        The matching events.

    Raises:
        AssertionError: listing the candidates.
    """
    hits = [e for e in candidates if matches(e.payload, payload)]
    asserted.update(e.id for e in hits)
    if (count is None and not hits) or (count is not None and len(hits) != count):
        expected = "at least one" if count is None else str(count)
        seen = "\n".join(f"  event {e.id} {e.topic!r}: {e.payload!r}" for e in candidates[:20])
        where = f" with payload ⊇ {dict(payload)!r}" if payload is not None else ""
        raise AssertionError(
            f"expected {expected} {topic!r} event(s){where}, found {len(hits)}; "
            f"{topic!r} events enqueued:\n{seen or '  (none)'}"
        )
    return hits


def refute_enqueued(candidates: list[Event], topic: str, payload: Mapping[str, Any] | None) -> None:
    """None of ``candidates`` has a payload containing ``payload``'s items.

    Args:
        candidates: the ``topic`` events to look among.
        topic: their topic (for the message).
        payload: a partial payload (any payload when None).

    Raises:
        AssertionError: listing the candidates that match.
    """
    hits = [e for e in candidates if matches(e.payload, payload)]
    if hits:
        shown = "\n".join(f"  event {e.id}: {e.payload!r}" for e in hits[:20])
        raise AssertionError(f"expected no {topic!r} event, found {len(hits)}:\n{shown}")
