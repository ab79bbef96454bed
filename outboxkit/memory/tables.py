"""The memory store's committed state, and every operation on it, behind one lock.

``Tables`` is what the memory store's objects share: the store, its transactions, its delivery
and batch transactions and its asyncio side each hold it and call its public methods; none reads
another's private state. ``Row``, ``Pending`` and ``Settle`` are its records.
"""

from __future__ import annotations

import heapq
import threading
import uuid
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from ..core.machine import Retry, Settlement, Transition, allowed, blocks_key, is_due
from ..core.model import (
    AttemptError,
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
from ..core.payload import decode_payload
from ..errors import LeaseLostError, StoreError
from ..storekit import SettleItem
from ..waiter import LoopWaiter, ThreadWaiter, Wakeable

if TYPE_CHECKING:
    from .transaction import MemoryTransaction

__all__ = ["Pending", "Row", "Settle", "Tables", "now_or_wall"]


@dataclass(slots=True)
class Row:
    """One event's row."""

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
    errors: list[AttemptError] = field(default_factory=list)  # each failed attempt's error

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

    def state(self, now: datetime | None = None) -> State:
        return state_of(
            published_at=self.published_at,
            failed_at=self.failed_at,
            locked_until=self.locked_until,
            now=now,
        )


@dataclass(slots=True)
class Settle:
    """A settlement waiting in a batch's transaction."""

    claim: Claim
    settlement: Settlement
    error: str | None
    at: datetime


@dataclass(slots=True)
class Pending:
    """A transaction's buffered writes, applied at its commit."""

    events: list[Row] = field(default_factory=list)
    records: list[DeliveryRecord] = field(default_factory=list)
    rows: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    settles: list[Settle] = field(default_factory=list)

    def mark(self) -> tuple[int, int, int, int]:
        """A savepoint: how long each list is now."""
        return len(self.events), len(self.records), len(self.rows), len(self.settles)

    def roll_back_to(self, mark: tuple[int, int, int, int]) -> None:
        del self.events[mark[0] :]
        del self.records[mark[1] :]
        del self.rows[mark[2] :]
        del self.settles[mark[3] :]


def now_or_wall(now: datetime | None) -> datetime:
    """``now``, or the wall clock (the memory store's own clock)."""
    return now if now is not None else datetime.now(UTC)


class Tables:
    """The committed state (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Condition(threading.RLock())
        self.events: dict[int, Row] = {}
        # Ids of the committed events neither published nor dead: what a claim looks through
        # (the partial due index of the SQL stores), so history does not slow claims down.
        self.live: set[int] = set()
        # R15: key -> the ids of its events not yet published (dead ones too), in commit order.
        self.keyed: dict[str, list[int]] = {}
        # R16: dedupe key -> the id of the committed event holding it; and the ones that open
        # transactions hold (a second enqueuer waits for that transaction, as on a unique index).
        self.dedupe: dict[str, int] = {}
        self.dedupe_open: dict[str, tuple[MemoryTransaction, int]] = {}
        # event id -> handler -> record, in the order written (one lookup per claimed event)
        self.records: dict[int, dict[str, DeliveryRecord]] = {}
        self.app_rows: dict[str, list[dict[str, Any]]] = {}
        self.next_id = 1
        self.closed = False
        # The pollers' waiters (``make_waiter``): a commit that adds events wakes them, as
        # PostgreSQL's NOTIFY does - an enqueue's own wake comes before its commit. Weakly
        # held: a poller that is dropped without closing its waiter (run_once,
        # run_until_idle) takes it along.
        self.waiters: weakref.WeakSet[Wakeable] = weakref.WeakSet()

    def check_open(self) -> None:
        """Raises:
        StoreError: the store is closed."""
        if self.closed:
            raise StoreError("the memory store is closed")

    # -- transactions ---------------------------------------------------------------------------

    def apply(self, pending: Pending) -> None:
        """Commit ``pending``: all of it, or (a second record, a stale settlement) none.

        Raises:
            StoreError: a record for a handler the event already has one for.
            LeaseLostError: a settlement's token is stale.
        """
        with self.lock:
            self.check_open()
            for rec in pending.records:  # check first: a commit applies all or nothing
                if rec.handler in self.records.get(rec.event_id, {}):
                    raise StoreError(
                        f"event {rec.event_id} already has a record for {rec.handler!r}"
                    )
            for settle in pending.settles:
                if self.settleable(settle.claim) is None:
                    raise LeaseLostError(f"event {settle.claim.event.id}: claim token is stale")
            for settle in pending.settles:
                row = self.events[settle.claim.event.id]
                self._settle(row, settle.settlement, settle.error, settle.at)
            for row in pending.events:
                self.events[row.id] = row
                self.live.add(row.id)
                if row.key is not None:  # R15: its place in the key's order is its commit's
                    self.keyed.setdefault(row.key, []).append(row.id)
                if row.dedupe_key is not None:
                    self.dedupe[row.dedupe_key] = row.id
                    self.dedupe_open.pop(row.dedupe_key, None)
            for rec in pending.records:
                self.records.setdefault(rec.event_id, {})[rec.handler] = rec
            for table, values in pending.rows:
                self.app_rows.setdefault(table, []).append(values)
            self.lock.notify_all()
            waiters = list(self.waiters) if pending.events else []
        for waiter in waiters:
            waiter.wake()

    def forget_dedupe(self, tx: MemoryTransaction) -> None:
        """A rolled-back transaction's dedupe keys are free again."""
        with self.lock:
            for dedupe_key in [k for k, (t, _) in self.dedupe_open.items() if t is tx]:
                del self.dedupe_open[dedupe_key]
            self.lock.notify_all()

    def rows_of(self, table: str) -> list[dict[str, Any]]:
        """Committed app rows of ``table``."""
        with self.lock:
            return [dict(r) for r in self.app_rows.get(table, [])]

    def enqueue(
        self, tx: MemoryTransaction, pending: Pending, events: Sequence[NewEvent], at: datetime
    ) -> list[int]:
        """Buffer ``events`` in ``tx``'s ``pending`` writes (R1, R16)."""
        ids: list[int] = []
        with self.lock:
            for ev in events:
                if ev.dedupe_key is not None:
                    taken = self._dedupe_holder(tx, ev.dedupe_key)
                    if taken is not None:
                        ids.append(taken)
                        continue
                row = Row(
                    id=self.next_id,
                    topic=ev.topic,
                    payload_json=ev.payload_json,
                    headers=dict(ev.headers),
                    key=ev.key,
                    created_at=at,
                    available_at=ev.available_at if ev.available_at is not None else at + ev.delay,
                    dedupe_key=ev.dedupe_key,
                    message_id=str(uuid.uuid4()),
                )
                self.next_id += 1
                pending.events.append(row)
                if ev.dedupe_key is not None:
                    self.dedupe_open[ev.dedupe_key] = (tx, row.id)
                ids.append(row.id)
        return ids

    def _dedupe_holder(self, tx: MemoryTransaction, dedupe_key: str) -> int | None:
        """R16: the id of the event holding ``dedupe_key`` (committed, or in ``tx``), or None.
        Waits while another open transaction holds it, as a unique index makes a second
        inserter wait: once that one commits its event is the holder; if it rolls back, none."""
        while True:
            if dedupe_key in self.dedupe:
                return self.dedupe[dedupe_key]
            holder = self.dedupe_open.get(dedupe_key)
            if holder is None or not holder[0].open:
                return None
            if holder[0] is tx:
                return holder[1]
            self.lock.wait()

    # -- claims, locks and leases ---------------------------------------------------------------

    def claim(
        self, batch_size: int, lease: timedelta, at: datetime, dead_key: DeadKey
    ) -> list[Claim]:
        with self.lock:
            self.check_open()
            heads = self._key_heads(at, dead_key)
            due = heapq.nsmallest(
                batch_size,
                (
                    row
                    for row in map(self.events.__getitem__, self.live)
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
        for key, ids in self.keyed.items():
            for event_id in ids:
                if blocks_key(self.events[event_id].state(at), dead_key):
                    heads[key] = event_id
                    break
        return heads

    def _done(self, event_id: int) -> dict[str, Outcome]:
        return {h: r.outcome for h, r in self.records.get(event_id, {}).items()}

    def owned(self, claim: Claim) -> Row | None:
        """The claim's row if its token still owns it."""
        row = self.events.get(claim.event.id)
        if row is None or row.token != claim.token:
            return None
        return row

    def settleable(self, claim: Claim) -> Row | None:
        """The claim's row if the token still owns it and it is neither published nor dead."""
        row = self.owned(claim)
        if row is None or row.published_at is not None or row.failed_at is not None:
            return None
        return row

    def lock_row(self, claim: Claim, holder: object) -> Row:
        """Check the claim's token and lock its row for ``holder``, as ``FOR UPDATE`` would:
        waiting while another transaction holds it, then checking the token again.

        Raises:
            LeaseLostError: the token is stale.
        """
        with self.lock:
            self.check_open()
            row = self.owned(claim)
            while row is not None and row.row_lock not in (None, holder):
                self.lock.wait()
                row = self.owned(claim)
            if row is None:
                raise LeaseLostError(f"event {claim.event.id}: claim token is stale")
            row.row_lock = holder
            return row

    def unlock(self, rows: Iterable[Row], holder: object) -> None:
        """Let go of the rows ``holder`` locked."""
        with self.lock:
            for row in rows:
                if row.row_lock is holder:
                    row.row_lock = None
            self.lock.notify_all()

    def extend(self, claims: Sequence[Claim], lease: timedelta, at: datetime) -> list[Claim]:
        kept = []
        with self.lock:
            for claim in claims:
                row = self.settleable(claim)
                if row is None:
                    continue
                row.locked_until = at + lease
                kept.append(replace(claim, locked_until=row.locked_until))
        return kept

    def settle_many(self, items: Sequence[SettleItem], at: datetime) -> list[bool]:
        done = []
        with self.lock:
            for claim, settlement, error in items:
                row = self.settleable(claim)
                if row is not None:
                    self._settle(row, settlement, error, at)
                done.append(row is not None)
        return done

    def release(self, claims: Sequence[Claim]) -> int:
        count = 0
        with self.lock:
            for claim in claims:
                row = self.settleable(claim)
                if row is None:
                    continue
                row.locked_until = None
                row.token = None
                row.attempts = max(0, row.attempts - 1)
                count += 1
        return count

    def requeue(self, ids: Iterable[int], at: datetime) -> int:
        count = 0
        with self.lock:
            for event_id in set(ids):
                row = self.events.get(event_id)
                if row is None or not allowed(row.state(), Transition.REQUEUE):
                    continue  # R12: only a dead event is requeued
                row.failed_at = None
                row.attempts = 0
                row.available_at = at
                row.locked_until = None
                row.token = None
                self.live.add(event_id)
                count += 1
        return count

    # -- reads and purges -----------------------------------------------------------------------

    def dead_letters(
        self, topic: str | None, since: datetime | None, limit: int
    ) -> list[DeadLetter]:
        with self.lock:
            rows = sorted(
                (
                    r
                    for r in self.events.values()
                    if r.failed_at is not None
                    and (topic is None or r.topic == topic)
                    and (since is None or r.failed_at >= since)
                ),
                key=lambda r: (r.failed_at, r.id),
            )[:limit]
            return [
                DeadLetter(
                    event=r.to_event(),
                    failed_at=failed_at,
                    last_error=r.last_error,
                    records=tuple(self.records_of(r.id)),
                )
                for r in rows
                if (failed_at := r.failed_at) is not None
            ]

    def get(self, event_id: int) -> Event | None:
        with self.lock:
            row = self.events.get(event_id)
            return row.to_event() if row is not None else None

    def list_events(self, after_id: int, topic: str | None, limit: int) -> list[Event]:
        with self.lock:
            rows = sorted(
                (
                    r
                    for r in self.events.values()
                    if r.id > after_id and (topic is None or r.topic == topic)
                ),
                key=lambda r: r.id,
            )[:limit]
            return [r.to_event() for r in rows]

    def records_of(self, event_id: int) -> list[DeliveryRecord]:
        with self.lock:
            return list(self.records.get(event_id, {}).values())

    def purge(self, doomed: Iterator[Row] | Iterable[Row], limit: int) -> int:
        """Delete at most ``limit`` of ``doomed`` (lowest ids first), with their records."""
        with self.lock:
            ids = sorted(r.id for r in doomed)[:limit]
            for event_id in ids:
                row = self.events.pop(event_id)
                self.live.discard(event_id)
                self._unkey(row)
                if row.dedupe_key is not None and self.dedupe.get(row.dedupe_key) == event_id:
                    del self.dedupe[row.dedupe_key]
                self.records.pop(event_id, None)
            return len(ids)

    def stats(self, at: datetime) -> Stats:
        counts = {"pending": 0, "claimed": 0, "published": 0, "dead": 0}
        by_topic: dict[str, dict[str, int]] = {}
        oldest: datetime | None = None
        held: set[str] = set()
        with self.lock:
            for r in self.events.values():
                if r.key is not None and r.failed_at is not None and r.published_at is None:
                    held.add(r.key)
                state = r.state(at).value
                due = state == "pending" and r.available_at <= at
                if due and (oldest is None or r.available_at < oldest):
                    oldest = r.available_at
                counts[state] += 1
                topic_counts = by_topic.setdefault(r.topic, {})
                topic_counts[state] = topic_counts.get(state, 0) + 1
        return Stats(
            **counts,
            by_topic=by_topic,
            oldest_due_at=oldest,
            held_keys=len(held),
            dead_keys=len(held),
        )

    # -- settlements ----------------------------------------------------------------------------

    def _settle(self, row: Row, settlement: Settlement, error: str | None, at: datetime) -> None:
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
        if state is not State.PUBLISHED and error is not None:
            row.errors.append(AttemptError(row.attempts, at, error))
        row.locked_until = None
        row.token = None
        if row.published_at is not None or row.failed_at is not None:
            self.live.discard(row.id)
        if row.published_at is not None:
            self._unkey(row)

    def watch(self, waiter: Wakeable) -> None:
        """Wake ``waiter`` at every commit that adds events, until ``unwatch`` (or until it is
        collected: held weakly)."""
        with self.lock:
            self.waiters.add(waiter)

    def unwatch(self, waiter: Wakeable) -> None:
        with self.lock:
            self.waiters.discard(waiter)

    def _unkey(self, row: Row) -> None:
        """A published (or purged) event no longer holds its key up."""
        if row.key is not None and row.id in (ids := self.keyed.get(row.key, [])):
            ids.remove(row.id)
            if not ids:
                del self.keyed[row.key]


class CommitWaiter(ThreadWaiter):
    """The memory store's waiter: a ``ThreadWaiter`` that a commit adding events also wakes."""

    def __init__(self, tables: Tables) -> None:
        super().__init__()
        self._tables = tables
        tables.watch(self)

    def close(self) -> None:
        self._tables.unwatch(self)

    def __repr__(self) -> str:
        return "CommitWaiter()"


class AsyncCommitWaiter(LoopWaiter):
    """``CommitWaiter`` for the asyncio poller."""

    def __init__(self, tables: Tables) -> None:
        super().__init__()
        self._tables = tables
        tables.watch(self)

    async def close(self) -> None:
        self._tables.unwatch(self)

    def __repr__(self) -> str:
        return "AsyncCommitWaiter()"
