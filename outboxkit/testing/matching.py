"""What the enqueue assertions match an event against: a nested partial payload with wildcards,
and the key, headers and scheduled time.

A pattern is matched against a value this way:

- ``ANY`` (or ``unittest.mock.ANY``) matches anything, a missing key excepted;
- a mapping matches a mapping that has each of its keys, each value matching (partially, to
  any depth: ``{"order": {"id": 42}}`` matches ``{"order": {"id": 42, "lines": [...]}}``);
- a list or tuple matches a list of the same length, item by item;
- a type matches an instance of it (``{"total": int}``);
- a compiled regular expression matches a string it fully matches;
- ``Matcher(predicate, "description")`` matches what ``predicate`` accepts;
- anything else matches what compares equal to it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from unittest import mock

from ..core.model import Event

__all__ = ["ANY", "Matcher", "EventFilter", "first_mismatch", "matches"]


class _Any:
    """Matches any value (``ANY``)."""

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "ANY"


ANY: Any = _Any()
"""A wildcard: matches any value, at any depth of a payload pattern, and any key or header."""


@dataclass(frozen=True)
class Matcher:
    """A value pattern made of a predicate: ``Matcher(lambda v: v > 0, "a positive number")``.

    Args:
        predicate: true for the values that match.
        description: how an assertion's message names it.
    """

    predicate: Callable[[Any], bool]
    description: str

    def __repr__(self) -> str:
        return f"<{self.description}>"


def first_mismatch(value: Any, pattern: Any, path: str = "") -> str | None:
    """Where ``value`` first differs from ``pattern`` (``payload.order.id: 41 != 42``), or None
    when it matches (see the module docstring)."""
    here = path or "payload"
    if isinstance(pattern, _Any) or pattern is _MOCK_ANY:
        return None
    if isinstance(pattern, Matcher):
        return None if _accepts(pattern, value) else f"{here}: {value!r:.60} is not {pattern!r}"
    if isinstance(pattern, Mapping):
        if not isinstance(value, Mapping):
            return f"{here}: {value!r:.60} is not a mapping"
        for key, sub in pattern.items():
            if key not in value:
                return f"{here}: no key {key!r}"
            found = first_mismatch(value[key], sub, f"{here}.{key}")
            if found is not None:
                return found
        return None
    if isinstance(pattern, list | tuple):
        if not isinstance(value, Sequence) or isinstance(value, str | bytes):
            return f"{here}: {value!r:.60} is not a list"
        if len(value) != len(pattern):
            return f"{here}: {len(value)} item(s), expected {len(pattern)}"
        for i, (item, sub) in enumerate(zip(value, pattern, strict=True)):
            found = first_mismatch(item, sub, f"{here}[{i}]")
            if found is not None:
                return found
        return None
    if isinstance(pattern, type):
        ok = isinstance(value, pattern) and not (pattern is int and isinstance(value, bool))
        return None if ok else f"{here}: {value!r:.60} is not a {pattern.__name__}"
    if isinstance(pattern, re.Pattern):
        ok = isinstance(value, str) and pattern.fullmatch(value) is not None
        return None if ok else f"{here}: {value!r:.60} does not match /{pattern.pattern}/"
    return None if value == pattern else f"{here}: {value!r:.60} != {pattern!r:.60}"


def matches(value: Any, pattern: Any) -> bool:
    """``value`` matches ``pattern`` (see the module docstring); None matches anything."""
    return pattern is None or first_mismatch(value, pattern) is None


def _accepts(matcher: Matcher, value: Any) -> bool:
    try:
        return bool(matcher.predicate(value))
    except Exception:  # a predicate that cannot judge a value does not accept it
        return False


_MOCK_ANY: Any = mock.ANY  # matches by equality already; named so it is seen as a wildcard


_UNSET: Any = object()


@dataclass(frozen=True)
class EventFilter:
    """What one ``assert_enqueued`` asks of an event: its topic, a payload pattern, its key, a
    headers pattern (partial: other headers may be there) and when it is scheduled.

    ``scheduled`` is an instant, or a duration from ``now`` (the test clock when the assertion
    runs), or a ``Matcher``/``ANY``.
    """

    topic: str
    payload: Any = None
    key: Any = _UNSET
    headers: Mapping[str, Any] | None = None
    scheduled: datetime | timedelta | Matcher | None = None
    now: datetime | None = None

    def mismatch(self, event: Event) -> str | None:
        """Why ``event`` does not match (the first thing that differs), or None."""
        if event.topic != self.topic:
            return f"topic {event.topic!r} != {self.topic!r}"
        if self.payload is not None:
            found = first_mismatch(event.payload, self.payload)
            if found is not None:
                return found
        if self.key is not _UNSET:
            found = first_mismatch(event.key, self.key, "key")
            if found is not None:
                return found
        if self.headers is not None:
            found = first_mismatch(dict(event.headers), dict(self.headers), "headers")
            if found is not None:
                return found
        if self.scheduled is not None:
            wanted: Any = self.scheduled
            if isinstance(wanted, timedelta):
                if self.now is None:
                    raise ValueError("a scheduled= duration needs the test clock's now")
                wanted = self.now + wanted
            found = first_mismatch(event.available_at, wanted, "scheduled (available_at)")
            if found is not None:
                return found
        return None

    def describe(self) -> str:
        """What the filter asks beyond the topic, as a message says it (`` with ...``)."""
        parts = [repr(self.topic)]
        if self.payload is not None:
            parts.append(f"payload ⊇ {self.payload!r}")
        if self.key is not _UNSET:
            parts.append(f"key {self.key!r}")
        if self.headers is not None:
            parts.append(f"headers ⊇ {dict(self.headers)!r}")
        if self.scheduled is not None:
            parts.append(f"scheduled {self.scheduled!r}")
        return " with " + ", ".join(parts[1:]) if parts[1:] else ""


UNSET: Any = _UNSET
"""The default of ``key=`` (a filter that asks nothing of the key; ``key=None`` asks for none)."""
