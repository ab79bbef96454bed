"""``Recorder``: an observer that keeps every observer event it is sent (a public test double)."""

from __future__ import annotations

from typing import Any, TypeVar

from ..core.model import ObserverEvent
from ..hookspecs import hookimpl

__all__ = ["Recorder"]

E = TypeVar("E", bound=ObserverEvent)


class Recorder:
    """An observer plugin that keeps every event it sees, in order.

    Example::

        recorder = Recorder()
        outbox = Outbox(store, bus, plugins=[recorder])
        ...
        assert recorder.of(DeadLettered) == [...]
    """

    def __init__(self) -> None:
        self.events: list[ObserverEvent] = []

    @hookimpl
    def outboxkit_on_event(self, event: ObserverEvent) -> None:
        """Keep ``event`` (the observer hook)."""
        self.events.append(event)

    def of(self, kind: type[E]) -> list[E]:
        """The events of one type (and its subclasses), in order.

        Args:
            kind: an ``ObserverEvent`` class (``Published``, ``DeadLettered`` ...).

        Returns:
            The kept events of that class.
        """
        return [e for e in self.events if isinstance(e, kind)]

    def clear(self) -> None:
        """Forget every event kept so far."""
        self.events.clear()

    def __repr__(self) -> str:
        return f"Recorder({len(self.events)} events)"

    def __eq__(self, other: Any) -> bool:
        return self is other

    __hash__ = object.__hash__
