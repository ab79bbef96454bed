"""What a drain left behind, and why (``DrainReport.left``): every event neither published
nor dead-lettered when the drain ended, with the reason it is still there."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from ..core.machine import blocks_key
from ..core.model import DeadKey, Event, State, state_of

__all__ = ["Left", "left_reasons"]


@dataclass(frozen=True)
class Left:
    """An event the drain left, and why (``reason``, one line a human reads)."""

    event: Event
    reason: str

    def __str__(self) -> str:
        return f"event {self.event.id} {self.event.topic!r}: {self.reason}"


def left_reasons(
    events: Sequence[Event],
    *,
    now: datetime,
    horizon: datetime | None,
    advance_time: bool,
    why_not: Callable[[Event], str | None],
    dead_key: DeadKey,
) -> list[Left]:
    """The events of ``events`` still to deliver at ``now``, each with its reason."""
    left: list[Left] = []
    held: dict[str, int] = {}
    for event in events:
        state = state_of(
            published_at=event.published_at,
            failed_at=event.failed_at,
            locked_until=event.locked_until,
            now=now,
        )
        if state in (State.PUBLISHED, State.DEAD):
            if event.key is not None and blocks_key(state, dead_key):
                held.setdefault(event.key, event.id)
            continue
        reason = _reason(event, state, now, horizon, advance_time, why_not, held)
        if event.key is not None:
            held.setdefault(event.key, event.id)
        left.append(Left(event, reason))
    return left


def _reason(
    event: Event,
    state: State,
    now: datetime,
    horizon: datetime | None,
    advance_time: bool,
    why_not: Callable[[Event], str | None],
    held: dict[str, int],
) -> str:
    if event.key is not None and event.key in held:
        return f"waits behind event {held[event.key]} of its key {event.key!r}"
    if state is State.CLAIMED:
        return f"leased until {event.locked_until} (a crash, or a poller elsewhere)"
    aimed = why_not(event)
    if aimed is not None:
        return aimed
    at = event.available_at
    if event.attempts:
        error = f" after {event.last_error!r:.120}" if event.last_error else ""
        wait = "advance_time=False" if not advance_time else "past the drain's reach"
        return f"retry (attempt {event.attempts + 1}) due at {at}{error}: {wait}"
    if at is not None and at > now:
        reach = f"until={horizon}" if horizon is not None else "no until="
        wait = "advance_time=False" if not advance_time else f"past the drain's reach ({reach})"
        return f"scheduled at {at}: {wait}"
    return f"due at {at}, not delivered (max_rounds?)"
