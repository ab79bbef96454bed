"""Rows in, values out (and values in, parameters out): the mapping both SQL stores share.

Every query that returns events selects the columns of ``EVENT_COLUMNS`` first, in that order;
a claim adds the token and the recorded handlers. A store passes its own converter for stored
instants (PostgreSQL hands back datetimes, SQLite integer microseconds).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from ..core.machine import Retry, Settlement
from ..core.model import (
    Claim,
    DeliveryRecord,
    Event,
    Outcome,
    State,
    Stats,
    StoredJSON,
    decode_payload,
    make_event,
)
from ..errors import ConfigurationError, StoreError

__all__ = [
    "EVENT_COLUMNS",
    "SETTLE_COLUMNS",
    "decode_headers",
    "done_from_pairs",
    "encode_headers",
    "event_from_row",
    "fold_stats",
    "record_from_row",
    "record_params",
    "inserted_ids",
    "message_id_text",
    "resolve_ids",
    "settle_row",
    "still_owned",
]

EVENT_COLUMNS = (
    "id",
    "topic",
    "payload",
    "headers",
    "key",
    "created_at",
    "available_at",
    "attempts",
    "published_at",
    "failed_at",
    "locked_until",
    "last_error",
    "message_id",
)
"""What every query returning events selects first, in this order. ``message_id`` is the
stored message identity: PostgreSQL's ``uuid`` as text, SQLite's 16 random bytes, NULL for a
row written before the store kept one (``message_id_text``)."""

Instant = Callable[[Any], datetime]


def encode_headers(headers: Mapping[str, str]) -> str:
    """Validated headers (``build_event``) as the JSON object text a store keeps."""
    return json.dumps(dict(headers), ensure_ascii=False, separators=(",", ":")) if headers else "{}"


def decode_headers(raw: str | bytes | Mapping[str, str] | None) -> dict[str, str]:
    if raw is None or raw == "{}":  # no headers, as nearly every event has
        return {}
    if isinstance(raw, Mapping):
        return dict(raw)
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}


_VARIANT = {d: "89ab"[int(d, 16) & 3] for d in "0123456789abcdef"}


def message_id_text(raw: str | bytes | None) -> str | None:
    """A stored message identity as ``Event.message_id`` holds it: PostgreSQL's ``uuid`` text
    as it is; SQLite's 16 random bytes as the text of a version 4 UUID (their version and
    variant bits set so); None (a row older than the column) as None, which ``Event`` reads
    as the decimal id."""
    if type(raw) is bytes and len(raw) == 16:
        h = raw.hex()
        return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{_VARIANT[h[16]]}{h[17:20]}-{h[20:]}"
    if isinstance(raw, bytes | bytearray | memoryview):
        return bytes(raw).hex() or None  # not one outboxkit wrote: its bytes, as they are
    return raw


def event_from_row(
    row: Sequence[Any], instant: Instant | None, *, json_column: bool = False
) -> Event:
    """An ``Event`` from the leading ``EVENT_COLUMNS`` of a row; ``instant`` turns a stored
    instant into an aware datetime (None: the row holds them so already, as PostgreSQL's
    ``timestamptz`` columns load). The payload may be JSON text or already parsed; text from
    a ``json_column`` (one the database keeps valid, as ``jsonb``) is decoded on first read
    (``StoredJSON``), other text at once (so that an undecodable one is dead-lettered)."""
    payload = row[2]
    if isinstance(payload, str) and json_column:
        payload = StoredJSON(payload)
    elif isinstance(payload, str | bytes):
        payload = decode_payload(payload)
    created_at, available_at = row[5], row[6]
    published_at, failed_at, locked_until = row[8], row[9], row[10]
    if instant is not None:
        created_at, available_at = instant(created_at), instant(available_at)
        if published_at is not None:
            published_at = instant(published_at)
        if failed_at is not None:
            failed_at = instant(failed_at)
        if locked_until is not None:
            locked_until = instant(locked_until)
    return make_event(  # positionally, in field order (a claim makes one per row: it counts)
        row[0],  # id
        row[1],  # topic
        payload,
        {} if row[3] == "{}" else decode_headers(row[3]),
        row[4],  # key
        created_at,
        available_at,
        row[7],  # attempts
        published_at,
        failed_at,
        locked_until,
        row[11],  # last_error
        message_id_text(row[12]),
    )


def record_from_row(row: Sequence[Any], instant: Instant) -> DeliveryRecord:
    """A ``DeliveryRecord`` from ``event_id, handler, outcome, attempt, recorded_at, reason``."""
    event_id, handler, outcome, attempt, recorded_at, reason = row
    return DeliveryRecord(
        event_id=event_id,
        handler=handler,
        outcome=Outcome(outcome),
        attempt=attempt,
        recorded_at=instant(recorded_at),
        reason=reason,
    )


def done_from_pairs(pairs: Iterable[Sequence[str]]) -> dict[str, Outcome]:
    """The ``Claim.done`` mapping from (handler, outcome) pairs."""
    if not pairs:  # no record yet, as nearly every claim has
        return {}
    return {handler: Outcome(outcome) for handler, outcome in pairs}


def record_params(
    claim: Claim, handler: str, outcome: Outcome, reason: str | None, now: Any
) -> dict[str, Any]:
    """The ``insert_record`` statement's parameters (the record guard: only a succeeded or
    rejected delivery is ever recorded).

    Raises:
        ConfigurationError: ``outcome`` is not one that is recorded.
    """
    if not outcome.recorded:
        raise ConfigurationError(f"only succeeded/rejected outcomes are recorded, got {outcome}")
    return {
        "event_id": claim.event.id,
        "handler": handler,
        "outcome": outcome._value_,  # the attribute ``value`` reads, without its descriptor
        "attempt": claim.event.attempts,  # the claim's attempt
        "now": now,
        "reason": reason,
    }


RECORD_COLUMNS = ("event_id", "token", "handler", "outcome", "attempt", "recorded_at", "reason")
"""What ``insert_records_fenced`` writes per kept record (``record_row``), in this order."""


def record_row(claim: Claim, params: Mapping[str, Any]) -> tuple[Any, ...]:
    """A kept record (``record_params``) as a row of ``RECORD_COLUMNS``."""
    return (
        params["event_id"],
        claim.token,
        params["handler"],
        params["outcome"],
        params["attempt"],
        params["now"],
        params["reason"],
    )


SETTLE_COLUMNS = ("id", "token", "publish", "dead", "retry_after", "keeps_error", "error")
"""What ``settle_many`` writes per event (``settle_row``), in this order."""


def settle_row(
    claim: Claim,
    settlement: Settlement,
    error: str | None,
    duration: Callable[[timedelta], Any],
) -> tuple[Any, ...]:
    """One event's ``SETTLE_COLUMNS``: the state the machine's table gives for the settlement
    (published, dead, or pending again after the retry's delay, ``duration`` converting it to
    the store's unit), the error kept with a retry or a dead letter, fenced by the token."""
    state = settlement.state
    retry_after = (
        duration(settlement.delay)
        if isinstance(settlement, Retry) and state is State.PENDING
        else None
    )
    keeps_error = state is not State.PUBLISHED
    return (
        claim.event.id,
        claim.token,
        state is State.PUBLISHED,
        state is State.DEAD,
        retry_after,
        keeps_error,
        error if keeps_error else None,
    )


def still_owned(claims: Iterable[Claim], lease_ends: Mapping[str, datetime]) -> list[Claim]:
    """The claims whose token the store extended (``token -> new lease end``), updated."""
    return [
        replace(claim, locked_until=lease_ends[claim.token])
        for claim in claims
        if claim.token in lease_ends
    ]


def fold_stats(rows: Iterable[Sequence[Any]], instant: Instant) -> Stats:
    """``Stats`` from ``topic, state, count, oldest due`` rows (one per topic and state)."""
    counts = {state.value: 0 for state in State}
    by_topic: dict[str, dict[str, int]] = {}
    oldest: Any = None
    held = 0
    for topic, state, count, oldest_due in rows:
        if topic is None:  # the keys with a dead event (R15)
            held = count
            continue
        counts[state] += count
        by_topic.setdefault(topic, {})[state] = count
        if oldest_due is not None and (oldest is None or oldest_due < oldest):
            oldest = oldest_due
    return Stats(
        pending=counts["pending"],
        claimed=counts["claimed"],
        published=counts["published"],
        dead=counts["dead"],
        by_topic=by_topic,
        oldest_due_at=None if oldest is None else instant(oldest),
        held_keys=held,
        dead_keys=held,
    )


def inserted_ids(
    events: Sequence[Any], returned: Iterable[Sequence[Any]]
) -> tuple[list[int | None], list[str]]:
    """R16: the ids of ``events`` (``NewEvent`` objects, in batch order) from the
    ``(id, dedupe_key)`` rows an ``INSERT ... ON CONFLICT (dedupe_key) DO NOTHING ...
    RETURNING`` gave back (ids increase in batch order), and the dedupe keys whose holder is
    an event stored before (None in their place: look them up, then ``resolve_ids``). An
    event whose dedupe key an earlier event of the batch took gets that one's id."""
    rows = sorted((row[0], row[1]) for row in returned)
    inserted_keys = {key for _, key in rows if key is not None}
    ids: list[int | None] = []
    holders: dict[str, int] = {}
    it = iter(rows)
    for event in events:
        key = event.dedupe_key
        if key is None or (key in inserted_keys and key not in holders):
            event_id = next(it)[0]
            ids.append(event_id)
            if key is not None:
                holders[key] = event_id
        else:
            ids.append(holders.get(key))
    missing = sorted({e.dedupe_key for e, i in zip(events, ids, strict=True) if i is None})
    return ids, missing


def resolve_ids(
    events: Sequence[Any], ids: Sequence[int | None], found: Mapping[str, int]
) -> list[int]:
    """``inserted_ids``' ids with the holders looked up (``found``: dedupe key -> id) in place.

    Raises:
        StoreError: a holder vanished between the insert and the lookup (purged meanwhile).
    """
    gone = sorted(
        {e.dedupe_key for e, i in zip(events, ids, strict=True) if i is None} - set(found)
    )
    if gone:
        raise StoreError(
            f"the events holding dedupe keys {gone[:5]} were purged while this enqueue ran: "
            "roll back and enqueue again"
        )
    return [found[e.dedupe_key] if i is None else i for e, i in zip(events, ids, strict=True)]
