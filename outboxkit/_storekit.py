"""Helpers every SQL store shares, so that the stores differ only in SQL and transactions.

No driver is imported here: values in, values out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from .core.machine import DeadLetter, Publish, Retry, Settlement
from .core.model import Claim, DeliveryRecord, Event, Outcome
from .core.payload import decode_payload
from .errors import ConfigurationError

__all__ = [
    "IDENTIFIER",
    "SettleValues",
    "decode_headers",
    "encode_headers",
    "event_from_row",
    "prefixed_table_names",
    "record_from_row",
    "settle_values",
    "sort_claims",
    "still_owned",
    "validate_identifier",
    "validate_table_names",
]

IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}\Z")


def validate_identifier(value: object, what: str) -> str:
    """``value`` if it is a safe SQL identifier (``^[A-Za-z_][A-Za-z0-9_]{0,62}$``).

    Raises:
        ConfigurationError: naming ``what`` and the bad value (shortened).
    """
    if not isinstance(value, str) or not IDENTIFIER.match(value):
        raise ConfigurationError(
            f"{what} must match ^[A-Za-z_][A-Za-z0-9_]{{0,62}}$, got {value!r:.80}"
        )
    return value


def validate_table_names(
    events: object,
    deliveries: object,
    schema_table: object,
    *,
    derived: Callable[[str, str], Iterable[str]] | None = None,
    ignore_case: bool = False,
) -> None:
    """The three table names every SQL store has: each a safe identifier, all different, and
    none named like an object the store derives from a table's name.

    Args:
        derived: the names of the objects (indexes, sequences...) the store derives from a
            table, as ``derived(option, table)`` with ``option`` one of ``events_table``,
            ``deliveries_table``, ``schema_table``.
        ignore_case: compare names ignoring (ASCII) case, as SQLite does.

    Raises:
        ConfigurationError: naming the bad option (``events_table``, ``deliveries_table``,
            ``schema_table``) and value, or the clash.
    """
    tables = {
        "events_table": validate_identifier(events, "events_table"),
        "deliveries_table": validate_identifier(deliveries, "deliveries_table"),
        "schema_table": validate_identifier(schema_table, "schema_table"),
    }

    def key(name: str) -> str:
        return name.lower() if ignore_case else name

    if len({key(name) for name in tables.values()}) != 3:
        raise ConfigurationError(
            "events_table, deliveries_table and schema_table must differ"
            f"{' ignoring case' if ignore_case else ''}, got {events!r}, {deliveries!r}, "
            f"{schema_table!r}"
        )
    if derived is None:
        return
    own = {
        key(name): (source, table, name)
        for source, table in tables.items()
        for name in derived(source, table)
    }
    for option, table in tables.items():
        if key(table) in own:
            source, base, name = own[key(table)]
            raise ConfigurationError(
                f"{option} must not be named like the store's own {name!r}, derived from "
                f"{source} {base!r}, got {table!r}"
            )


def prefixed_table_names(prefix: object) -> tuple[str, str, str]:
    """``{prefix}events``, ``{prefix}deliveries``, ``{prefix}schema``, validated.

    Raises:
        ConfigurationError: the prefix is not a string or makes an unsafe name.
    """
    if not isinstance(prefix, str):
        validate_identifier(prefix, "table_prefix")  # raises, naming the option
    names = (f"{prefix}events", f"{prefix}deliveries", f"{prefix}schema")
    for name in names:
        validate_identifier(name, "table_prefix")
    return names


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


def event_from_row(
    *,
    id: int,
    topic: str,
    payload: Any,
    headers: Any,
    key: str | None,
    created_at: datetime,
    available_at: datetime,
    attempts: int,
    published_at: datetime | None = None,
    failed_at: datetime | None = None,
    locked_until: datetime | None = None,
    last_error: str | None = None,
) -> Event:
    """An ``Event`` from stored columns; ``payload`` may be JSON text or an already-parsed value."""
    return Event(
        published_at=published_at,
        failed_at=failed_at,
        locked_until=locked_until,
        last_error=last_error,
        id=id,
        topic=topic,
        payload=decode_payload(payload) if isinstance(payload, str | bytes) else payload,
        headers=decode_headers(headers),
        key=key,
        created_at=created_at,
        available_at=available_at,
        attempts=attempts,
    )


def record_from_row(
    *,
    event_id: int,
    handler: str,
    outcome: str,
    attempt: int,
    recorded_at: datetime,
    reason: str | None,
) -> DeliveryRecord:
    return DeliveryRecord(
        event_id=event_id,
        handler=handler,
        outcome=Outcome(outcome),
        attempt=attempt,
        recorded_at=recorded_at,
        reason=reason,
    )


def done_from_pairs(pairs: Iterable[tuple[str, str]]) -> dict[str, Outcome]:
    """The ``Claim.done`` mapping from (handler, outcome) pairs."""
    return {handler: Outcome(outcome) for handler, outcome in pairs}


@dataclass(frozen=True, slots=True)
class SettleValues:
    """What settling writes, besides clearing the lease: which column gets ``now``, and the
    retry delay (``available_at = now + retry_after``) where there is one."""

    publish: bool
    dead: bool
    retry_after: timedelta | None
    keeps_error: bool


def settle_values(settlement: Settlement) -> SettleValues:
    """Map a settlement decision to column updates (one UPDATE in every SQL store)."""
    if isinstance(settlement, Publish):
        return SettleValues(publish=True, dead=False, retry_after=None, keeps_error=False)
    if isinstance(settlement, DeadLetter):
        return SettleValues(publish=False, dead=True, retry_after=None, keeps_error=True)
    if isinstance(settlement, Retry):
        return SettleValues(
            publish=False, dead=False, retry_after=settlement.delay, keeps_error=True
        )
    raise TypeError(f"unknown settlement {settlement!r}")  # pragma: no cover - closed union


def settle_params(
    claim: Claim,
    settlement: Settlement,
    *,
    error: str | None,
    now: object,
    retry_after: Callable[[timedelta], object] = lambda delay: delay,
) -> dict[str, Any]:
    """The parameters of a store's one-event ``settle`` statement (R8, fenced by the token):
    the ``settle_values`` flags, the error, ``now`` and the claim's id and token.
    ``retry_after`` converts the retry delay to the store's unit."""
    values = settle_values(settlement)
    return {
        "publish": values.publish,
        "dead": values.dead,
        "retry_after": None if values.retry_after is None else retry_after(values.retry_after),
        "keeps_error": values.keeps_error,
        "error": error,
        "now": now,
        "id": claim.event.id,
        "token": claim.token,
    }


def still_owned(claims: Iterable[Claim], lease_ends: Mapping[str, datetime]) -> list[Claim]:
    """The claims whose token the store extended (``token -> new lease end``), updated."""
    return [
        replace(claim, locked_until=lease_ends[claim.token])
        for claim in claims
        if claim.token in lease_ends
    ]


def sort_claims(claims: Iterable[Claim]) -> list[Claim]:
    """Claim order (R3/R5): oldest ``(available_at, id)`` first; RETURNING has no order."""
    return sorted(claims, key=lambda c: (c.event.available_at, c.event.id))
