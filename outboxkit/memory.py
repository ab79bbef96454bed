"""The in-memory store: a real, transactional implementation of the Store protocol.

It is the reference the conformance suite is written against, and the store to use in unit tests
of an app that has no database of its own. Writes are buffered in a ``MemoryTransaction`` and
applied atomically at commit; a rolled-back transaction leaves no trace. A delivery transaction
holds a row lock on its event, and claims skip locked rows, as ``FOR UPDATE SKIP LOCKED`` does.
All state sits behind one lock, so pollers in several threads may share a store.

Usage::

    store = MemoryStore()
    with store.transaction() as tx:          # the "app transaction"
        outbox.enqueue(tx, "order.placed", {"order_id": 42})
        tx.insert("orders", {"id": 42})      # app rows, committed together
"""

from __future__ import annotations

import heapq
import threading
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Any

from .core.machine import Retry, Settlement, Transition, allowed, blocks_key, is_due
from .core.model import (
    Claim,
    DeadKey,
    DeadLetter,
    DeliveryRecord,
    Event,
    NewEvent,
    Outcome,
    State,
    Stats,
    state_of,
)
from .core.payload import decode_payload
from .errors import ConfigurationError, HandlerCrashed, LeaseLostError, StoreError
from .hookspecs import RegisterStore, hookimpl
from .storekit import (
    AsyncBatchBase,
    AsyncDeliveriesBase,
    AsyncStoreBase,
    BatchBase,
    Capabilities,
    SettleItem,
    StoreBase,
)
from .waiter import AsyncClosingWaiter, ClosingWaiter

__all__ = ["MemoryStore", "MemoryTransaction"]


@dataclass(slots=True)
class _Row:
    id: int
    topic: str
    payload_json: str
    headers: Mapping[str, str]
    key: str | None
    created_at: datetime
    available_at: datetime
    attempts: int = 0
    locked_until: datetime | None = None
    token: str | None = None
    published_at: datetime | None = None
    failed_at: datetime | None = None
    last_error: str | None = None
    row_lock: object | None = None  # the delivery transaction holding this row
    dedupe_key: str | None = None
    message_id: str = ""  # a random UUID's text, drawn at enqueue (Event.message_id)

    def to_event(self) -> Event:
        return Event(
            id=self.id,
            topic=self.topic,
            payload=decode_payload(self.payload_json),
            headers=dict(self.headers),
            key=self.key,
            created_at=self.created_at,
            available_at=self.available_at,
            attempts=self.attempts,
            published_at=self.published_at,
            failed_at=self.failed_at,
            locked_until=self.locked_until,
            last_error=self.last_error,
            message_id=self.message_id,
        )


@dataclass(slots=True)
class _Settle:
    claim: Claim
    settlement: Settlement
    error: str | None
    at: datetime


@dataclass(slots=True)
class _Pending:
    events: list[_Row] = field(default_factory=list)
    records: list[DeliveryRecord] = field(default_factory=list)
    rows: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    settles: list[_Settle] = field(default_factory=list)

    def mark(self) -> tuple[int, int, int, int]:
        """A savepoint: how long each list is now."""
        return len(self.events), len(self.records), len(self.rows), len(self.settles)

    def roll_back_to(self, mark: tuple[int, int, int, int]) -> None:
        del self.events[mark[0] :]
        del self.records[mark[1] :]
        del self.rows[mark[2] :]
        del self.settles[mark[3] :]


class MemoryTransaction:
    """An open transaction on a ``MemoryStore``: the "connection" handed to enqueue and handlers.

    Writes (events, delivery records, app rows) become visible to others only at ``commit()``.
    """

    def __init__(self, store: MemoryStore, *, managed: bool = False) -> None:
        self._store = store
        self._pending = _Pending()
        self._managed = managed
        self.open = True
        # What a handler tried to do to its delivery transaction (refused), if it did: the
        # delivery then fails, whatever the handler made of the refusal (R17).
        self.refused: str | None = None

    def insert(self, table: str, row: Mapping[str, Any]) -> None:
        """Insert an app row into ``table``; it commits or rolls back with the transaction."""
        self._check_open()
        self._pending.rows.append((table, dict(row)))

    def rows(self, table: str) -> list[dict[str, Any]]:
        """Committed rows of ``table`` plus this transaction's own inserts."""
        self._check_open()
        own = [dict(r) for t, r in self._pending.rows if t == table]
        return self._store.rows(table) + own

    def commit(self) -> None:
        """Apply every buffered write atomically.

        Raises:
            StoreError: the transaction is already closed.
            HandlerCrashed: called by a handler on its delivery transaction (outboxkit commits
                it together with the delivery record).
        """
        self._refuse_if_managed("commit")
        self._commit()

    def rollback(self) -> None:
        """Discard every buffered write. Safe to call twice.

        Raises:
            HandlerCrashed: called by a handler on its delivery transaction.
        """
        self._refuse_if_managed("roll back")
        self._rollback()

    def _commit(self) -> None:
        self._check_open()
        self._store._apply(self._pending)
        self.open = False

    def _rollback(self) -> None:
        self._pending = _Pending()
        self.open = False
        self._store._forget_dedupe(self)

    def _refuse_if_managed(self, what: str) -> None:
        if self._managed:
            self.refused = what
            raise HandlerCrashed(
                f"a handler may not {what} its delivery transaction: outboxkit commits it "
                "together with the delivery record"
            )

    def _check_open(self) -> None:
        if not self.open:
            raise StoreError("this memory transaction is already committed or rolled back")

    def __repr__(self) -> str:
        return f"<MemoryTransaction {'open' if self.open else 'closed'}>"


class _MemoryDelivery:
    """A delivery transaction: a MemoryTransaction plus the claim it is fenced by."""

    def __init__(
        self, store: MemoryStore, claim: Claim, now: datetime, tx: MemoryTransaction | None = None
    ) -> None:
        self._store = store
        self._claim = claim
        self._now = now
        # Its own transaction, or (in a batch) the batch's.
        self.tx = tx if tx is not None else MemoryTransaction(store, managed=True)

    @property
    def connection(self) -> MemoryTransaction:
        return self.tx

    def check_kept(self) -> None:
        """R17: the handler did not try to end its delivery transaction.

        Raises:
            HandlerCrashed: it tried to (refused, whatever it made of the refusal).
        """
        if self.tx.refused is not None:
            raise HandlerCrashed(
                f"event {self._claim.event.id}: a handler tried to {self.tx.refused} its "
                "delivery transaction; outboxkit commits it together with the delivery record, "
                "so nothing of this delivery was committed and it runs again"
            )

    def enqueue(self, events: Sequence[NewEvent]) -> list[int]:
        return self._store.enqueue(self.tx, events, now=self._now)

    def record(self, handler: str, outcome: Outcome, *, reason: str | None = None) -> None:
        if not outcome.recorded:
            raise ConfigurationError(
                f"only succeeded/rejected outcomes are recorded, got {outcome}"
            )
        self.tx._check_open()
        self.tx._pending.records.append(
            DeliveryRecord(
                event_id=self._claim.event.id,
                handler=handler,
                outcome=outcome,
                attempt=self._claim.attempt,
                recorded_at=self._now,
                reason=reason,
            )
        )


class _MemoryBatch(BatchBase):
    """One transaction for a claimed batch (``transaction="per_batch"``): deliveries are
    savepoints of it, settlements wait in it, and it commits once."""

    def __init__(self, store: MemoryStore) -> None:
        self._store = store
        self.tx = MemoryTransaction(store, managed=True)
        self.locked: dict[int, _Row] = {}  # event id -> the row this batch holds

    @contextmanager
    def delivery(self, claim: Claim, *, now: datetime | None) -> Iterator[_MemoryDelivery]:
        store = self._store
        self._lock(claim)
        delivery = _MemoryDelivery(store, claim, _now(now), self.tx)
        mark = self.tx._pending.mark()
        self.tx.refused = None
        try:
            yield delivery
            delivery.check_kept()
        except BaseException:
            self.tx._pending.roll_back_to(mark)
            raise

    def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        """Each settlement waits in the batch's transaction: applied when it commits."""
        at = _now(now)
        done = []
        for claim, settlement, error in items:
            try:
                self._lock(claim)
            except LeaseLostError:
                done.append(False)
                continue
            with self._store._lock:
                settleable = self._store._settleable(claim) is not None
            if settleable:
                self.tx._pending.settles.append(_Settle(claim, settlement, error, at))
            done.append(settleable)
        return done

    def _lock(self, claim: Claim) -> None:
        self.locked[claim.event.id] = self._store._lock_row(claim, self)

    def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        # Applied at once (nothing to roll back but the lease), but claims this batch has
        # settled are no longer owned, as inside a database transaction.
        settled = {s.claim.token for s in self.tx._pending.settles}
        live = [c for c in claims if c.token not in settled]
        return self._store.extend(live, lease=lease, now=now)


class MemoryStore(StoreBase):
    """A transactional in-memory store (``memory://``). Thread-safe; one process only."""

    capabilities = Capabilities(
        batches=True,
        transactional_handlers=True,
        concurrent_claimers=True,
        concurrent_batches=True,
        asyncio=True,
        ordering=True,
        dedupe=True,
    )
    url: str | None = None  # another process's memory:// is another store
    options: Mapping[str, Any] = MappingProxyType({})

    def __init__(self) -> None:
        self._lock = threading.Condition(threading.RLock())
        self._events: dict[int, _Row] = {}
        # Ids of the committed events neither published nor dead: what a claim looks through
        # (the partial due index of the SQL stores), so history does not slow claims down.
        self._live: set[int] = set()
        # R15: key -> the ids of its events not yet published (dead ones too), in commit order.
        self._keyed: dict[str, list[int]] = {}
        # R16: dedupe key -> the id of the committed event holding it; and the ones that open
        # transactions hold (a second enqueuer waits for that transaction, as on a unique index).
        self._dedupe: dict[str, int] = {}
        self._dedupe_open: dict[str, tuple[MemoryTransaction, int]] = {}
        # event id -> handler -> record, in the order written (one lookup per claimed event)
        self._records: dict[int, dict[str, DeliveryRecord]] = {}
        self._tables: dict[str, list[dict[str, Any]]] = {}
        self._next_id = 1
        self._closed = False

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MemoryStore:
        """The factory behind ``open_store("memory://")``; every call gives a new, empty store."""
        if options:
            raise ConfigurationError(f"memory:// takes no options, got {sorted(options)}")
        if url.rstrip("/").lower() != "memory:":
            raise ConfigurationError(f"the memory store's URL is just 'memory://', got {url!r}")
        return cls()

    def __repr__(self) -> str:
        return f"MemoryStore({len(self._events)} events)"

    # -- transactions ---------------------------------------------------------------------------

    def begin(self) -> MemoryTransaction:
        """A new open transaction; call ``commit()`` or ``rollback()`` on it."""
        self._check_open()
        return MemoryTransaction(self)

    @contextmanager
    def transaction(self) -> Iterator[MemoryTransaction]:
        """An app transaction: committed when the block ends, rolled back if it raises."""
        tx = self.begin()
        try:
            yield tx
        except BaseException:
            tx._rollback()
            raise
        tx._commit()

    def rows(self, table: str) -> list[dict[str, Any]]:
        """Committed app rows of ``table``."""
        with self._lock:
            return [dict(r) for r in self._tables.get(table, [])]

    def _apply(self, pending: _Pending) -> None:
        with self._lock:
            self._check_open()
            for rec in pending.records:  # check first: a commit applies all or nothing
                if rec.handler in self._records.get(rec.event_id, {}):
                    raise StoreError(
                        f"event {rec.event_id} already has a record for {rec.handler!r}"
                    )
            for settle in pending.settles:
                if self._settleable(settle.claim) is None:
                    raise LeaseLostError(f"event {settle.claim.event.id}: claim token is stale")
            for settle in pending.settles:
                row = self._events[settle.claim.event.id]
                self._settle(row, settle.settlement, settle.error, settle.at)
            for row in pending.events:
                self._events[row.id] = row
                self._live.add(row.id)
                if row.key is not None:  # R15: its place in the key's order is its commit's
                    self._keyed.setdefault(row.key, []).append(row.id)
                if row.dedupe_key is not None:
                    self._dedupe[row.dedupe_key] = row.id
                    self._dedupe_open.pop(row.dedupe_key, None)
            for rec in pending.records:
                self._records.setdefault(rec.event_id, {})[rec.handler] = rec
            for table, values in pending.rows:
                self._tables.setdefault(table, []).append(values)
            self._lock.notify_all()

    # -- Store protocol -------------------------------------------------------------------------

    def migrate(self) -> None:
        """Nothing to create: the memory store has no versioned schema (returns None)."""
        self._check_open()

    def close(self) -> None:
        with self._lock:
            self._closed = True

    def now(self) -> datetime:
        self._check_open()
        return _now(None)

    def enqueue(self, conn: Any, events: Sequence[NewEvent], *, now: datetime | None) -> list[int]:
        if not isinstance(conn, MemoryTransaction) or conn._store is not self:
            raise ConfigurationError(
                "the memory store enqueues through a transaction of the same store "
                f"(store.transaction() or store.begin()), got {conn!r}"
            )
        conn._check_open()
        at = _now(now)
        ids: list[int] = []
        with self._lock:
            for ev in events:
                if ev.dedupe_key is not None:
                    taken = self._dedupe_holder(conn, ev.dedupe_key)
                    if taken is not None:
                        ids.append(taken)
                        continue
                row = _Row(
                    id=self._next_id,
                    topic=ev.topic,
                    payload_json=ev.payload_json,
                    headers=dict(ev.headers),
                    key=ev.key,
                    created_at=at,
                    available_at=ev.available_at if ev.available_at is not None else at + ev.delay,
                    dedupe_key=ev.dedupe_key,
                    message_id=str(uuid.uuid4()),
                )
                self._next_id += 1
                conn._pending.events.append(row)
                if ev.dedupe_key is not None:
                    self._dedupe_open[ev.dedupe_key] = (conn, row.id)
                ids.append(row.id)
        return ids

    def _dedupe_holder(self, conn: MemoryTransaction, dedupe_key: str) -> int | None:
        """R16: the id of the event holding ``dedupe_key`` (committed, or in ``conn``), or None.
        Waits while another open transaction holds it, as a unique index makes a second
        inserter wait: once that one commits its event is the holder; if it rolls back, none."""
        while True:
            if dedupe_key in self._dedupe:
                return self._dedupe[dedupe_key]
            holder = self._dedupe_open.get(dedupe_key)
            if holder is None or not holder[0].open:
                return None
            if holder[0] is conn:
                return holder[1]
            self._lock.wait()

    def _forget_dedupe(self, tx: MemoryTransaction) -> None:
        """A rolled-back transaction's dedupe keys are free again."""
        with self._lock:
            for dedupe_key in [k for k, (t, _) in self._dedupe_open.items() if t is tx]:
                del self._dedupe_open[dedupe_key]
            self._lock.notify_all()

    def claim(
        self,
        *,
        batch_size: int,
        lease: timedelta,
        now: datetime | None,
        dead_key: DeadKey = "release",
    ) -> list[Claim]:
        at = _now(now)
        with self._lock:
            self._check_open()
            heads = self._key_heads(at, dead_key)
            due = heapq.nsmallest(
                batch_size,
                (
                    row
                    for row in map(self._events.__getitem__, self._live)
                    if row.row_lock is None
                    and (row.key is None or heads.get(row.key) == row.id)
                    and is_due(
                        published_at=row.published_at,
                        failed_at=row.failed_at,
                        available_at=row.available_at,
                        locked_until=row.locked_until,
                        now=at,
                    )
                ),
                key=lambda r: (r.available_at, r.id),
            )
            claims = []
            for row in due:
                row.attempts += 1
                row.locked_until = at + lease
                row.token = uuid.uuid4().hex
                claims.append(
                    Claim(
                        event=row.to_event(),
                        token=row.token,
                        locked_until=row.locked_until,
                        done=self._done(row.id),
                    )
                )
            return claims

    def _key_heads(self, at: datetime, dead_key: DeadKey) -> dict[str, int]:
        """R15: for each key, its first event (in commit order) that holds the key up; only
        that one may be claimed, and only when it is due."""
        heads = {}
        for key, ids in self._keyed.items():
            for event_id in ids:
                if blocks_key(self._state(self._events[event_id], at), dead_key):
                    heads[key] = event_id
                    break
        return heads

    def _done(self, event_id: int) -> dict[str, Outcome]:
        return {h: r.outcome for h, r in self._records.get(event_id, {}).items()}

    @contextmanager
    def delivery(self, claim: Claim, *, now: datetime | None) -> Iterator[_MemoryDelivery]:
        at = _now(now)
        delivery = _MemoryDelivery(self, claim, at)
        row = self._lock_row(claim, delivery)
        try:
            yield delivery
            delivery.check_kept()
        except BaseException:
            delivery.tx._rollback()
            raise
        else:
            with self._lock:
                if self._owned(claim) is None:  # cannot happen while we hold the row lock
                    delivery.tx._rollback()
                    raise LeaseLostError(f"event {claim.event.id}: claim token is stale")
                delivery.tx._commit()
        finally:
            with self._lock:
                if row.row_lock is delivery:
                    row.row_lock = None
                self._lock.notify_all()

    def _lock_row(self, claim: Claim, holder: object) -> _Row:
        """Check the claim's token and lock its row for ``holder``, as ``FOR UPDATE`` would:
        waiting while another transaction holds it, then checking the token again.

        Raises:
            LeaseLostError: the token is stale.
        """
        with self._lock:
            self._check_open()
            row = self._owned(claim)
            while row is not None and row.row_lock not in (None, holder):
                self._lock.wait()
                row = self._owned(claim)
            if row is None:
                raise LeaseLostError(f"event {claim.event.id}: claim token is stale")
            row.row_lock = holder
            return row

    @contextmanager
    def batch(self, *, now: datetime | None) -> Iterator[_MemoryBatch]:
        """One transaction for a claimed batch (the ``batched_delivery`` capability)."""
        self._check_open()
        batch = _MemoryBatch(self)
        try:
            yield batch
        except BaseException:
            batch.tx._rollback()
            raise
        else:
            batch.tx._commit()
        finally:
            with self._lock:
                for row in batch.locked.values():
                    if row.row_lock is batch:
                        row.row_lock = None
                self._lock.notify_all()

    def _settleable(self, claim: Claim) -> _Row | None:
        """The claim's row if the token still owns it and it is neither published nor dead."""
        row = self._owned(claim)
        if row is None or row.published_at is not None or row.failed_at is not None:
            return None
        return row

    def _owned(self, claim: Claim) -> _Row | None:
        row = self._events.get(claim.event.id)
        if row is None or row.token != claim.token:
            return None
        return row

    def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        at = _now(now)
        kept = []
        with self._lock:
            for claim in claims:
                row = self._owned(claim)
                if row is None or row.published_at is not None or row.failed_at is not None:
                    continue
                row.locked_until = at + lease
                kept.append(replace(claim, locked_until=row.locked_until))
        return kept

    def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        at = _now(now)
        done = []
        with self._lock:
            for claim, settlement, error in items:
                row = self._settleable(claim)
                if row is not None:
                    self._settle(row, settlement, error, at)
                done.append(row is not None)
        return done

    def make_waiter(self) -> ClosingWaiter | None:
        """None: an enqueue wakes this process's pollers directly (``Outbox.wake``)."""
        return None

    def async_store(self) -> _AsyncMemory:
        """The asyncio side: the same store, its calls awaitable (nothing here waits on I/O).
        A delivery's connection is the ``MemoryTransaction``, as for blocking handlers."""
        return _AsyncMemory(self)

    def release(self, claims: Sequence[Claim], *, now: datetime | None) -> int:
        count = 0
        with self._lock:
            for claim in claims:
                row = self._owned(claim)
                if row is None or row.published_at is not None or row.failed_at is not None:
                    continue
                row.locked_until = None
                row.token = None
                row.attempts = max(0, row.attempts - 1)
                count += 1
        return count

    def requeue(self, ids: Iterable[int], *, now: datetime | None) -> int:
        at = _now(now)
        count = 0
        with self._lock:
            for event_id in set(ids):
                row = self._events.get(event_id)
                if row is None or not allowed(self._state(row), Transition.REQUEUE):
                    continue  # R12: only a dead event is requeued
                row.failed_at = None
                row.attempts = 0
                row.available_at = at
                row.locked_until = None
                row.token = None
                self._live.add(event_id)
                count += 1
        return count

    def dead_letters(
        self, *, topic: str | None = None, since: datetime | None = None, limit: int = 100
    ) -> list[DeadLetter]:
        with self._lock:
            rows = sorted(
                (
                    r
                    for r in self._events.values()
                    if r.failed_at is not None
                    and (topic is None or r.topic == topic)
                    and (since is None or r.failed_at >= since)
                ),
                key=lambda r: (r.failed_at, r.id),
            )[:limit]
            return [
                DeadLetter(
                    event=r.to_event(),
                    failed_at=r.failed_at,  # type: ignore[arg-type]  # filtered above
                    last_error=r.last_error,
                    records=tuple(self._records_of(r.id)),
                )
                for r in rows
            ]

    def get(self, event_id: int) -> Event | None:
        with self._lock:
            row = self._events.get(event_id)
            return row.to_event() if row is not None else None

    def events(
        self, *, after_id: int = 0, topic: str | None = None, limit: int = 1000
    ) -> list[Event]:
        with self._lock:
            rows = sorted(
                (
                    r
                    for r in self._events.values()
                    if r.id > after_id and (topic is None or r.topic == topic)
                ),
                key=lambda r: r.id,
            )[:limit]
            return [r.to_event() for r in rows]

    def records(self, event_id: int) -> list[DeliveryRecord]:
        with self._lock:
            return self._records_of(event_id)

    def _records_of(self, event_id: int) -> list[DeliveryRecord]:
        return list(self._records.get(event_id, {}).values())

    def purge_published(self, *, before: datetime, limit: int) -> int:
        with self._lock:
            doomed = sorted(
                (
                    r
                    for r in self._events.values()
                    if r.published_at is not None and r.published_at < before
                ),
                key=lambda r: r.id,
            )[:limit]
            return self._delete(r.id for r in doomed)

    def purge_dead(
        self, *, ids: Iterable[int] | None = None, before: datetime | None = None, limit: int
    ) -> int:
        wanted = None if ids is None else set(ids)
        with self._lock:
            doomed = sorted(
                (
                    r
                    for r in self._events.values()
                    if r.failed_at is not None
                    and (wanted is None or r.id in wanted)
                    and (before is None or r.failed_at < before)
                ),
                key=lambda r: r.id,
            )[:limit]
            return self._delete(r.id for r in doomed)

    def _delete(self, ids: Iterable[int]) -> int:
        doomed = set(ids)
        for event_id in doomed:
            row = self._events.pop(event_id)
            self._live.discard(event_id)
            self._unkey(row)
            if row.dedupe_key is not None and self._dedupe.get(row.dedupe_key) == event_id:
                del self._dedupe[row.dedupe_key]
        for event_id in doomed:
            self._records.pop(event_id, None)
        return len(doomed)

    def stats(self, *, now: datetime | None) -> Stats:
        at = _now(now)
        counts = {"pending": 0, "claimed": 0, "published": 0, "dead": 0}
        by_topic: dict[str, dict[str, int]] = {}
        oldest: datetime | None = None
        held: set[str] = set()
        with self._lock:
            for r in self._events.values():
                if r.key is not None and r.failed_at is not None and r.published_at is None:
                    held.add(r.key)
                state = self._state(r, at).value
                due = state == "pending" and r.available_at <= at
                if due and (oldest is None or r.available_at < oldest):
                    oldest = r.available_at
                counts[state] += 1
                topic_counts = by_topic.setdefault(r.topic, {})
                topic_counts[state] = topic_counts.get(state, 0) + 1
        return Stats(**counts, by_topic=by_topic, oldest_due_at=oldest, held_keys=len(held))

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the memory store is closed")

    @staticmethod
    def _state(row: _Row, now: datetime | None = None) -> State:
        return state_of(
            published_at=row.published_at,
            failed_at=row.failed_at,
            locked_until=row.locked_until,
            now=now,
        )

    def _settle(self, row: _Row, settlement: Settlement, error: str | None, at: datetime) -> None:
        _settle_row(row, settlement, error, at)
        if row.published_at is not None or row.failed_at is not None:
            self._live.discard(row.id)
        if row.published_at is not None:
            self._unkey(row)

    def _unkey(self, row: _Row) -> None:
        """A published (or purged) event no longer holds its key up."""
        if row.key is not None and row.id in (ids := self._keyed.get(row.key, ())):
            ids.remove(row.id)  # type: ignore[union-attr]
            if not ids:
                del self._keyed[row.key]


def _now(now: datetime | None) -> datetime:
    return now if now is not None else datetime.now(UTC)


def _settle_row(row: _Row, settlement: Settlement, error: str | None, at: datetime) -> None:
    """R8: the row in the state the machine's table gives for the settlement, its lease
    cleared."""
    state = settlement.state
    if state is State.PUBLISHED:
        row.published_at = at
    elif state is State.DEAD:
        row.failed_at = at
        row.last_error = error
    else:  # PENDING again: a retry after its delay
        assert isinstance(settlement, Retry)
        row.available_at = at + settlement.delay
        row.last_error = error
    row.locked_until = None
    row.token = None


class _AsyncDelivery:
    """A delivery transaction for async code: the blocking one's writes, awaitable."""

    def __init__(self, tx: _MemoryDelivery) -> None:
        self._tx = tx

    async def open(self) -> None:
        """Nothing to do: a memory delivery is open from the start."""

    @property
    def connection(self) -> MemoryTransaction:
        return self._tx.connection

    async def enqueue(self, events: Sequence[NewEvent]) -> list[int]:
        return self._tx.enqueue(events)

    async def record(self, handler: str, outcome: Outcome, *, reason: str | None = None) -> None:
        self._tx.record(handler, outcome, reason=reason)


class _AsyncDeliveries(AsyncDeliveriesBase):
    """The async twin of the store or of one of its batches (``Deliveries``)."""

    def __init__(self, deliveries: MemoryStore | _MemoryBatch) -> None:
        self._deliveries = deliveries

    @asynccontextmanager
    async def delivery(
        self, claim: Claim, *, now: datetime | None
    ) -> AsyncIterator[_AsyncDelivery]:
        with self._deliveries.delivery(claim, now=now) as tx:
            yield _AsyncDelivery(tx)

    async def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        return self._deliveries.extend(claims, lease=lease, now=now)

    async def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        return self._deliveries.settle_many(items, now=now)


class _AsyncMemoryBatch(_AsyncDeliveries, AsyncBatchBase):
    """The async twin of one of the store's batches."""


class _AsyncMemory(_AsyncDeliveries, AsyncStoreBase):
    """``MemoryStore.async_store()``."""

    def __init__(self, store: MemoryStore) -> None:
        super().__init__(store)
        self._store = store

    async def enqueue(
        self, conn: Any, events: Sequence[NewEvent], *, now: datetime | None
    ) -> list[int]:
        return self._store.enqueue(conn, events, now=now)

    async def claim(
        self,
        *,
        batch_size: int,
        lease: timedelta,
        now: datetime | None,
        dead_key: DeadKey = "release",
    ) -> list[Claim]:
        return self._store.claim(batch_size=batch_size, lease=lease, now=now, dead_key=dead_key)

    @asynccontextmanager
    async def batch(self, *, now: datetime | None) -> AsyncIterator[_AsyncMemoryBatch]:
        with self._store.batch(now=now) as batch:
            yield _AsyncMemoryBatch(batch)

    async def release(self, claims: Sequence[Claim], *, now: datetime | None) -> int:
        return self._store.release(claims, now=now)

    def make_waiter(self) -> AsyncClosingWaiter | None:
        return None

    async def close(self) -> None:
        """Nothing of its own to release."""


class _MemoryPlugin:
    """The memory store's registration; the ``outboxkit`` entry point names ``plugin``.

    A small object rather than this module, so registering it scans a handful of names.
    """

    @staticmethod
    @hookimpl
    def outboxkit_register_stores(register: RegisterStore) -> None:
        """Register ``memory://``."""
        register("memory", MemoryStore.from_url, schemes=("memory",))


plugin = _MemoryPlugin()
