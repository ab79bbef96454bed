"""Frozen value types shared by the core, the stores and the observers.

PURE: no I/O, no clock, no driver. Everything here is a plain immutable value.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, make_dataclass
from datetime import datetime, timedelta
from typing import Any, Literal, TypeVar

__all__ = [
    "DEAD_KEY_CHOICES",
    "AttemptError",
    "Claim",
    "Claimed",
    "DeadKey",
    "Delivery",
    "DeadLetter",
    "DeadLettered",
    "DeliveryRecord",
    "Event",
    "HandlerFailed",
    "HandlerRejected",
    "HandlerStarted",
    "HandlerSucceeded",
    "LeaseLost",
    "Migration",
    "NewEvent",
    "ObserverEvent",
    "Outcome",
    "PollReport",
    "Published",
    "RetryScheduled",
    "State",
    "Stats",
    "StoredJSON",
    "UndecodablePayload",
    "Unrouted",
    "decode_payload",
    "payload_is_undecodable",
    "state_of",
    "stored_payload_text",
]

JSON = Any
"""A JSON value: dict, list, str, int, float, bool or None (validated at enqueue)."""

DeadKey = Literal["release", "hold"]
"""What a dead event does to its key (R15): ``"release"`` lets the key's later events go on,
``"hold"`` keeps them waiting until the dead event is requeued or purged."""
DEAD_KEY_CHOICES: tuple[DeadKey, ...] = ("release", "hold")


class State(enum.Enum):
    """Where an event is in its lifecycle (see ``machine`` for the transitions)."""

    # Members are singletons compared by identity: hash them so too (in C). Enum's own hash is
    # a Python method, and the transition table hashes two members on every lookup.
    __hash__ = object.__hash__

    PENDING = "pending"
    CLAIMED = "claimed"
    PUBLISHED = "published"
    DEAD = "dead"


def state_of(
    *,
    published_at: datetime | None,
    failed_at: datetime | None,
    locked_until: datetime | None,
    now: datetime | None,
) -> State:
    """The lifecycle state of a stored event at ``now``; without ``now``, a lease is not
    looked at (PENDING for an event that is neither published nor dead). The one place a
    state is derived from stored columns (``Event.state``, the stores, the test kit)."""
    if published_at is not None:
        return State.PUBLISHED
    if failed_at is not None:
        return State.DEAD
    if now is not None and locked_until is not None and locked_until > now:
        return State.CLAIMED
    return State.PENDING


class Outcome(enum.Enum):
    """What one delivery of an event to one handler ended with.

    Only ``SUCCEEDED`` and ``REJECTED`` are ever recorded; ``FAILED`` (an exception),
    ``CRASHED`` (a ``BaseException`` or a lost process) and ``LEASE_LOST`` (another poller took
    the event over while the handler ran: its run was not recorded) leave no record, so the
    handler runs again on the next attempt.
    """

    __hash__ = object.__hash__  # identity, as ``State``

    SUCCEEDED = "succeeded"
    REJECTED = "rejected"
    FAILED = "failed"
    CRASHED = "crashed"
    LEASE_LOST = "lease_lost"

    @property
    def recorded(self) -> bool:
        return self is _SUCCEEDED or self is _REJECTED


_SUCCEEDED, _REJECTED = Outcome.SUCCEEDED, Outcome.REJECTED


@dataclass(frozen=True, slots=True)
class NewEvent:
    """A validated event on its way into a store (see ``outboxkit._payload``)."""

    topic: str
    payload_json: str
    headers: Mapping[str, str]
    key: str | None
    delay: timedelta
    dedupe_key: str | None = None
    """While an event with this dedupe key exists, enqueueing another is a no-op."""
    available_at: datetime | None = None
    """An absolute due instant (aware); None: ``now + delay``."""


@dataclass(frozen=True, slots=True)
class UndecodablePayload:
    """Stands for a stored payload that is not JSON (written behind outboxkit's back).

    The poller dead-letters such an event at once with ``error``; no handler sees it.
    """

    raw: str
    error: str


def decode_payload(text: str | bytes) -> Any:
    """Parse a stored payload; one that is not JSON (written behind outboxkit's back) comes back
    as an ``UndecodablePayload`` carrying the error, so the event can be dead-lettered."""
    try:
        return json.loads(text)
    except (TypeError, ValueError) as exc:
        raw = text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text)
        return UndecodablePayload(raw=raw, error=f"stored payload is not valid JSON: {exc}")


class StoredJSON:
    """A stored payload's JSON text, not decoded yet, that the store vouches is JSON (a
    PostgreSQL ``jsonb`` column): ``Event.payload`` decodes it on first read.

    A store passes one as ``Event(payload=StoredJSON(text))``; nobody else sees it.
    """

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"StoredJSON({self.text[:60]!r})"


_T = TypeVar("_T")


def quick_maker(cls: type[_T]) -> Callable[..., _T]:
    """What a call of ``cls`` (a frozen dataclass with slots) makes, made faster, for the hot
    paths: the same instance (of type ``cls``, frozen, equal to the one ``cls(...)`` makes)
    built by a twin class with the same slots, whose ``__init__`` stores them plainly, and then
    handed to ``cls`` by ``__class__`` (allowed: the two lay their slots out alike). A frozen
    dataclass's own ``__init__`` calls ``object.__setattr__`` once per field: 1.2 µs for an
    ``Event`` against 0.3 this way. ``cls`` must have no ``__post_init__`` (it is not run).
    """
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__} has a __post_init__ that quick_maker would skip")
    twin = make_dataclass(
        f"_{cls.__name__}Maker",
        [
            (f.name, f.type, field(default=f.default, default_factory=f.default_factory))
            for f in fields(cls)  # type: ignore[arg-type]
        ],
        slots=True,
        eq=False,
        repr=False,
        match_args=False,
    )

    def make(*args: Any, **kwargs: Any) -> _T:
        made: Any = twin(*args, **kwargs)
        made.__class__ = cls
        return made  # type: ignore[no-any-return]

    make.__doc__ = f"``{cls.__name__}(...)``, made faster (``quick_maker``)."
    return make


@dataclass(frozen=True, slots=True)
class Event:
    """An event as handlers (and operators) see it.

    ``published_at``, ``failed_at``, ``locked_until`` and ``last_error`` describe where the
    event stands; stores fill them in for ``get``/``events``, and they are ``None`` otherwise.

    A store may hand over the payload as its stored JSON text (``StoredJSON``), decoded on the
    first read of ``payload``: a relay sends that text as it is (``stored_payload_text``), so
    an event that only goes to a broker is never decoded and encoded again. Equality, ``repr``
    and ``dataclasses.replace`` read ``payload``, so they see the decoded value.

    ``id`` is the store's local id: unique in one store only (two databases both have an event
    1). ``message_id`` is the event's identity outside its store, what a relay sends as the
    message's id and a consumer's ``Inbox`` keys on: a random UUID (its text) drawn when the
    event was written, the same on every read and every re-publish of the event. An event
    written before its store had one (a row older than the schema upgrade that added it), or
    built by hand without one, has its decimal ``id`` instead, the identity its messages
    carried before.
    """

    id: int
    topic: str
    payload: JSON
    headers: Mapping[str, str] = field(default_factory=dict)
    key: str | None = None
    created_at: datetime | None = None
    available_at: datetime | None = None
    attempts: int = 0
    published_at: datetime | None = None
    failed_at: datetime | None = None
    locked_until: datetime | None = None
    last_error: str | None = None
    message_id: str = field(default="", compare=False)
    """The event's message identity (see the class docstring); ``""`` or None given: the
    decimal ``id``. Not part of equality: it is random, so an event a test builds by hand
    still equals the one its store reads back."""

    @property
    def state(self) -> State:
        """PUBLISHED, DEAD, or PENDING (a lease is not a state here: it needs ``now``)."""
        return state_of(
            published_at=self.published_at,
            failed_at=self.failed_at,
            locked_until=self.locked_until,
            now=None,
        )


# ``Event.payload`` reads through the slot: a ``StoredJSON`` is decoded once, on first read, and
# the slot then holds the value (a frozen dataclass's __init__ sets it through this property too).
_payload_slot: Any = Event.__dict__["payload"]


def _read_payload(event: Event) -> JSON:
    value = _payload_slot.__get__(event, Event)
    if type(value) is StoredJSON:
        value = decode_payload(value.text)
        _payload_slot.__set__(event, value)
    return value


setattr(  # noqa: B010 - mypy keeps seeing the field's type
    Event,
    "payload",
    property(_read_payload, _payload_slot.__set__, doc="The event's payload (a JSON value)."),
)


# ``Event.message_id`` reads through its slot too: a store hands over None (or ``""``) for a
# row written before it kept message ids, and the identity of such an event is its decimal id.
_message_id_slot: Any = Event.__dict__["message_id"]


def _read_message_id(event: Event) -> str:
    value = _message_id_slot.__get__(event, Event)
    return value if value else str(event.id)


setattr(  # noqa: B010 - as ``payload`` above
    Event,
    "message_id",
    property(
        _read_message_id,
        _message_id_slot.__set__,
        doc="The event's message identity: its UUID text, or its decimal id (a legacy row).",
    ),
)


make_event: Callable[..., Event] = quick_maker(Event)
"""``Event(...)`` for the stores' reads, made faster (``quick_maker``)."""


def stored_payload_text(event: Event) -> str | None:
    """``event``'s payload as the store's JSON text, while nothing has read ``payload`` yet;
    None for a payload already decoded (or an event not read from such a store)."""
    value = _payload_slot.__get__(event, Event)
    return value.text if type(value) is StoredJSON else None


def payload_is_undecodable(event: Event) -> bool:
    """Whether ``event``'s stored payload is not JSON, without decoding a payload the store
    vouches for (``StoredJSON`` is JSON)."""
    value = _payload_slot.__get__(event, Event)
    return type(value) is not StoredJSON and isinstance(value, UndecodablePayload)


@dataclass(frozen=True, slots=True)
class DeliveryRecord:
    """A recorded outcome of one (event, handler) pair: succeeded or rejected."""

    event_id: int
    handler: str
    outcome: Outcome
    attempt: int
    recorded_at: datetime
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class AttemptError:
    """One failed attempt of an event, as the store keeps it (``capabilities.error_history``):
    the attempt's number (the event's ``attempts`` when it failed), when its settlement was
    written, and the error (the words of ``last_error``: the failing handler's name first)."""

    attempt: int
    at: datetime
    error: str


@dataclass(frozen=True, slots=True)
class Claim:
    """One event leased to one poller.

    ``token`` fences every later write (delivery, extension, settle): once another poller
    has re-claimed the event, writes under the old token change nothing. ``done`` maps the
    handlers that already have a delivery record to their outcome, so they are skipped.
    ``locked_until`` is the lease end as the store computed it.
    """

    event: Event
    token: str
    locked_until: datetime
    done: Mapping[str, Outcome] = field(default_factory=dict)

    @property
    def attempt(self) -> int:
        return self.event.attempts


make_claim: Callable[..., Claim] = quick_maker(Claim)
"""``Claim(...)`` for the stores' claims, made faster (``quick_maker``)."""


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A dead-lettered event with why it died and what its handlers recorded."""

    event: Event
    failed_at: datetime
    last_error: str | None
    records: tuple[DeliveryRecord, ...] = ()


@dataclass(frozen=True, slots=True)
class Stats:
    """Counts by state (and by topic), as a store reports them."""

    pending: int = 0
    claimed: int = 0
    published: int = 0
    dead: int = 0
    by_topic: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    oldest_due_at: datetime | None = None
    held_keys: int = 0
    """Keys held by a dead event: their later events wait until it is requeued or purged.
    A store (``Store.stats``) counts the keys a ``dead_key="hold"`` claim would hold, as it
    knows no policy; ``Outbox.stats()`` counts them under its own policy: ``dead_keys``
    under ``"hold"``, 0 under ``"release"`` (nothing is held)."""
    dead_keys: int = 0
    """Keys with a dead event, whatever the policy."""

    @property
    def total(self) -> int:
        return self.pending + self.claimed + self.published + self.dead


@dataclass(frozen=True, slots=True)
class Migration:
    """What ``migrate()`` did: the schema version found (0: there was none) and the one left.

    ``str()`` says it for an operator: ``created schema v5``, ``upgraded 4 -> 5``,
    ``already at v5``.
    """

    before: int
    after: int

    @property
    def changed(self) -> bool:
        """Whether anything was created or upgraded."""
        return self.before != self.after

    def __str__(self) -> str:
        if self.before == 0:
            return f"created schema v{self.after}"
        if self.changed:
            return f"upgraded {self.before} -> {self.after}"
        return f"already at v{self.after}"


@dataclass(frozen=True, slots=True)
class Delivery:
    """One handler run: what happened, when, on which attempt."""

    event_id: int
    topic: str
    handler: str
    attempt: int
    outcome: Outcome
    at: datetime
    error: str | None = None
    exception: BaseException | None = field(default=None, compare=False, repr=False)


make_delivery: Callable[..., Delivery] = quick_maker(Delivery)
"""``Delivery(...)`` for the pollers, made faster (``quick_maker``)."""


@dataclass(slots=True)
class PollReport:
    """What one ``run_once`` did: event ids per result and every handler run (``deliveries``),
    in claim order."""

    claimed: list[int] = field(default_factory=list)
    published: list[int] = field(default_factory=list)
    retried: list[int] = field(default_factory=list)
    dead_lettered: list[int] = field(default_factory=list)
    lease_lost: list[int] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)

    @property
    def rejected(self) -> list[Delivery]:
        return [d for d in self.deliveries if d.outcome is Outcome.REJECTED]

    @property
    def failed(self) -> list[Delivery]:
        return [d for d in self.deliveries if d.outcome is Outcome.FAILED]

    def __bool__(self) -> bool:
        return bool(self.claimed)


# -- observer events -------------------------------------------------------------------------
# Emitted by the poller through the ``outboxkit_on_event`` hook. Small, frozen, no live objects.
# Fields added later are keyword-only with a default, so that existing constructions still hold;
# the measured ones (instants, durations, batch positions) do not take part in equality.


@dataclass(frozen=True, slots=True)
class ObserverEvent:
    """What every observer event carries: the event's id and topic, and (``created_at``) when
    the event was enqueued, by the store's clock (None where the store did not say)."""

    event_id: int
    topic: str
    created_at: datetime | None = field(default=None, kw_only=True, compare=False)


@dataclass(frozen=True, slots=True)
class Claimed(ObserverEvent):
    """The event was claimed; ``batch_size`` events were taken by that claim, this one at
    ``position`` (0-based) in it."""

    attempt: int
    batch_size: int = field(default=1, kw_only=True, compare=False)
    position: int = field(default=0, kw_only=True, compare=False)


@dataclass(frozen=True, slots=True)
class HandlerStarted(ObserverEvent):
    """A handler is about to run for the event, at ``started_at`` (the outbox's clock)."""

    handler: str
    attempt: int
    started_at: datetime | None = field(default=None, kw_only=True, compare=False)


@dataclass(frozen=True, slots=True)
class HandlerSucceeded(ObserverEvent):
    """``duration``: how long the handler's run took, its record included (local clock)."""

    handler: str
    attempt: int
    duration: timedelta | None = field(default=None, kw_only=True, compare=False)


@dataclass(frozen=True, slots=True)
class HandlerRejected(ObserverEvent):
    handler: str
    attempt: int
    reason: str
    duration: timedelta | None = field(default=None, kw_only=True, compare=False)


@dataclass(frozen=True, slots=True)
class HandlerFailed(ObserverEvent):
    handler: str
    attempt: int
    error: str
    duration: timedelta | None = field(default=None, kw_only=True, compare=False)


@dataclass(frozen=True, slots=True)
class RetryScheduled(ObserverEvent):
    attempt: int
    delay: timedelta
    error: str | None


@dataclass(frozen=True, slots=True)
class Published(ObserverEvent):
    attempt: int


@dataclass(frozen=True, slots=True)
class Unrouted(ObserverEvent):
    """No handler is subscribed to the topic; the event is published straight away (R9)."""


@dataclass(frozen=True, slots=True)
class DeadLettered(ObserverEvent):
    attempt: int
    error: str | None


@dataclass(frozen=True, slots=True)
class LeaseLost(ObserverEvent):
    """The poller no longer owns the event: its writes under the old token changed nothing."""

    attempt: int
    handler: str | None = None
