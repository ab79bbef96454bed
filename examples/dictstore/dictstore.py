"""A store written only against ``outboxkit.storekit``: events, tokens and records in dicts.

The worked example of "Writing a store" (``docs/writing-a-store.md``): the twelve methods
``StoreBase`` requires, and nothing else (every other member is ``StoreBase``'s default). It
declares no capability beyond the least (``Capabilities()``): one process, per-event deliveries
only — no batches, no asyncio side, no per-key order, no dedupe keys — and the conformance suite
skips the checks of what it does not declare, saying so::

    cd examples/dictstore
    outboxkit conformance dictstore:make_store
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from outboxkit.storekit import (
    Capabilities,
    Claim,
    ConfigurationError,
    DeadKey,
    DeliveryRecord,
    Event,
    LeaseLostError,
    NewEvent,
    Outcome,
    PublishSettlement,
    RetrySettlement,
    SettleItem,
    Settlement,
    StoreBase,
    StoreError,
    decode_payload,
    make_claim,
)

__all__ = ["DictDelivery", "DictStore", "DictTransaction", "make_store"]


class DictTransaction:
    """An open transaction on a ``DictStore`` (what ``transaction()`` yields and ``enqueue``
    takes): its events and records wait here until the store applies them, all at once."""

    def __init__(self, store: DictStore) -> None:
        self.store = store
        self.events: list[Event] = []
        self.records: list[DeliveryRecord] = []


class DictDelivery:
    """One event's delivery transaction (``DeliveryTransaction``): a ``DictTransaction``
    whose records are stamped with the claim's attempt."""

    def __init__(self, store: DictStore, claim: Claim, now: datetime) -> None:
        self.connection = DictTransaction(store)
        self._claim = claim
        self._now = now

    def enqueue(self, events: Sequence[NewEvent]) -> list[int]:
        """Follow-up events, written when the delivery commits."""
        return self.connection.store.enqueue(self.connection, events, now=self._now)

    def record(self, handler: str, outcome: Outcome, *, reason: str | None = None) -> None:
        """The handler's record, written when the delivery commits.

        Raises:
            ConfigurationError: ``outcome`` is not one that is recorded.
        """
        if not outcome.recorded:
            raise ConfigurationError(f"only succeeded and rejected are recorded, got {outcome}")
        claim = self._claim
        self.connection.records.append(
            DeliveryRecord(claim.event.id, handler, outcome, claim.attempt, self._now, reason)
        )


class DictStore(StoreBase):
    """Events, tokens and records in dicts, behind one lock: one process, per-event deliveries
    only (no batches, no asyncio side, no per-key order, no dedupe keys). Everything but the
    twelve required methods is ``StoreBase``'s default."""

    capabilities = Capabilities()

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._events: dict[int, Event] = {}
        self._tokens: dict[int, str] = {}  # event id -> the token of its live claim
        self._records: dict[int, list[DeliveryRecord]] = {}
        self._next_id = 1

    def __repr__(self) -> str:
        return f"DictStore({len(self._events)} events)"

    # -- writing events ---------------------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[DictTransaction]:
        tx = DictTransaction(self)
        yield tx  # an exception leaves the block: nothing is applied
        self._apply(tx)

    def enqueue(self, conn: Any, events: Sequence[NewEvent], *, now: datetime | None) -> list[int]:
        if not isinstance(conn, DictTransaction) or conn.store is not self:
            raise ConfigurationError(f"{self!r} enqueues through its transaction(), got {conn!r}")
        at = self._at(now)
        ids = []
        with self._lock:
            for new in events:
                event = Event(
                    id=self._next_id,
                    topic=new.topic,
                    payload=decode_payload(new.payload_json),
                    headers=dict(new.headers),
                    key=new.key,
                    created_at=at,
                    available_at=new.available_at or at + new.delay,
                    message_id=str(uuid.uuid4()),
                )
                self._next_id += 1
                conn.events.append(event)
                ids.append(event.id)
        return ids

    # -- claims and deliveries --------------------------------------------------------------

    def claim(
        self,
        *,
        batch_size: int,
        lease: timedelta,
        now: datetime | None,
        dead_key: DeadKey = "release",  # no per-key order here: nothing for it to hold
    ) -> list[Claim]:
        at = self._at(now)
        with self._lock:
            due = sorted(
                (e.available_at, e.id)
                for e in self._events.values()
                if e.published_at is None
                and e.failed_at is None
                and e.available_at is not None
                and e.available_at <= at
                and (e.locked_until is None or e.locked_until <= at)
            )
            claims = []
            for _, event_id in due[:batch_size]:
                old = self._events[event_id]
                event = replace(old, attempts=old.attempts + 1, locked_until=at + lease)
                self._events[event_id] = event
                token = self._tokens[event_id] = uuid.uuid4().hex
                done = {r.handler: r.outcome for r in self._records.get(event_id, [])}
                claims.append(make_claim(event, token, at + lease, done))
            return claims

    @contextmanager
    def delivery(self, claim: Claim, *, now: datetime | None) -> Iterator[DictDelivery]:
        if not self._owns(claim):
            raise LeaseLostError(f"event {claim.event.id}: claim token is stale")
        tx = DictDelivery(self, claim, self._at(now))
        yield tx  # an exception leaves the block: nothing is applied
        with self._lock:
            if not self._owns(claim):  # taken over while the handler ran
                raise LeaseLostError(f"event {claim.event.id}: claim token is stale")
            self._apply(tx.connection)

    def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        until = self._at(now) + lease
        with self._lock:
            owned = [claim for claim in claims if self._owns(claim)]
            for claim in owned:
                self._events[claim.event.id] = replace(
                    self._events[claim.event.id], locked_until=until
                )
            return [replace(claim, locked_until=until) for claim in owned]

    def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        at = self._at(now)
        with self._lock:
            return [
                self._settle(claim, settlement, error, at) for claim, settlement, error in items
            ]

    def release(self, claims: Sequence[Claim], *, now: datetime | None) -> int:
        with self._lock:
            owned = [claim for claim in claims if self._owns(claim)]
            for claim in owned:
                del self._tokens[claim.event.id]
                event = self._events[claim.event.id]
                self._events[event.id] = replace(
                    event, attempts=event.attempts - 1, locked_until=None
                )
            return len(owned)

    # -- operations -------------------------------------------------------------------------

    def requeue(self, ids: Iterable[int], *, now: datetime | None) -> int:
        at = self._at(now)
        with self._lock:
            dead = [i for i in set(ids) if i in self._events and self._events[i].failed_at]
            for event_id in dead:
                self._events[event_id] = replace(
                    self._events[event_id], failed_at=None, attempts=0, available_at=at
                )
            return len(dead)

    def events(
        self, *, after_id: int = 0, topic: str | None = None, limit: int = 1000
    ) -> list[Event]:
        with self._lock:
            events = sorted(self._events.items())
        return [e for i, e in events if i > after_id and topic in (None, e.topic)][:limit]

    def records(self, event_id: int) -> list[DeliveryRecord]:
        with self._lock:
            return list(self._records.get(event_id, []))

    def purge_published(self, *, before: datetime, limit: int) -> int:
        with self._lock:
            return self._delete(
                [
                    event_id
                    for event_id, e in sorted(self._events.items())
                    if e.published_at is not None and e.published_at < before
                ][:limit]
            )

    def purge_dead(
        self, *, ids: Iterable[int] | None = None, before: datetime | None = None, limit: int
    ) -> int:
        wanted = None if ids is None else set(ids)
        with self._lock:
            return self._delete(
                [
                    event_id
                    for event_id, e in sorted(self._events.items())
                    if e.failed_at is not None
                    and (wanted is None or event_id in wanted)
                    and (before is None or e.failed_at < before)
                ][:limit]
            )

    # -- helpers ----------------------------------------------------------------------------

    def _at(self, now: datetime | None) -> datetime:
        """The instant to write with: the one given, else the store's clock."""
        return now if now is not None else self.now()

    def _owns(self, claim: Claim) -> bool:
        """Whether ``claim``'s token still owns its event (the fence of every write)."""
        return self._tokens.get(claim.event.id) == claim.token

    def _apply(self, tx: DictTransaction) -> None:
        """Commit ``tx``: all of it, or (a record written twice) none of it."""
        with self._lock:
            for record in tx.records:
                if any(r.handler == record.handler for r in self._records.get(record.event_id, [])):
                    raise StoreError(f"event {record.event_id} has a {record.handler!r} record")
            self._events.update((event.id, event) for event in tx.events)
            for record in tx.records:
                self._records.setdefault(record.event_id, []).append(record)

    def _settle(
        self, claim: Claim, settlement: Settlement, error: str | None, at: datetime
    ) -> bool:
        if not self._owns(claim):
            return False
        del self._tokens[claim.event.id]
        event = replace(self._events[claim.event.id], locked_until=None)
        match settlement:
            case PublishSettlement():
                event = replace(event, published_at=at)
            case RetrySettlement(delay=delay):
                event = replace(event, available_at=at + delay, last_error=error)
            case _:  # DeadLetterSettlement
                event = replace(event, failed_at=at, last_error=error)
        self._events[event.id] = event
        return True

    def _delete(self, ids: list[int]) -> int:
        for event_id in ids:
            del self._events[event_id]
            self._records.pop(event_id, None)
            self._tokens.pop(event_id, None)
        return len(ids)


def make_store() -> DictStore:
    """The factory ``outboxkit conformance dictstore:make_store`` runs the suite with: a fresh,
    empty store per test."""
    return DictStore()
