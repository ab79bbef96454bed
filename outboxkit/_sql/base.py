"""``SQLStore``: the Store protocol's operations, written once for every SQL dialect.

A SQL store subclasses ``SQLStore`` and fills in the dialect seam - how it reads and writes
(transactions, connections, its driver's errors mapped to outboxkit's), how it runs one of its
named statements, and how it binds an instant, a duration and an array - plus what is its own
(enqueue through the app's connection, the delivery transaction, the batch transaction,
migrations). Its ``queries.sql`` holds the statements named here with the parameters named here:

=============== ============================================ ============================
statement       parameters                                   returns
=============== ============================================ ============================
claim           now, lease, batch_size, hold                 EVENT_COLUMNS, token, done
extend          now, lease, ids, tokens                      token, locked_until
settle_many     now, and the store's shape of SETTLE_COLUMNS id
publish_many    now, ids, tokens                             id
release         ids, tokens                                  id
requeue         ids, now                                     id
dead_letters    topic, since, limit                          EVENT_COLUMNS
get             id                                           EVENT_COLUMNS
events          after_id, topic, limit                       EVENT_COLUMNS
records         ids                                          the record columns
purge_published before, limit                                id (records go along)
purge_dead      ids, before, limit                           id (records go along)
stats           now                                          topic, state, count, oldest
=============== ============================================ ============================

``publish_many`` is ``settle_many`` for the usual round, in which every event is published:
the ids and the tokens alone (``_settle_many_query`` picks it).

A store whose ``settles_recording`` is true also has ``settle_many_recording``: settle_many's
parameters plus insert_records_fenced's (``ids`` renamed ``record_ids``, no ``tokens``),
returning the ids settled.

Each write is one of the machine's transitions (``outboxkit.core.machine.TRANSITIONS``):
``claim`` is CLAIM, ``release`` RELEASE, ``requeue`` REQUEUE, and ``settle_many`` writes the
state ``settlement.state`` gives from the table (PUBLISH, RETRY or DEAD_LETTER, see
``rows.settle_row``); a lease running out (LEASE_EXPIRE) is no write at all.
"""

from __future__ import annotations

import operator
from abc import abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from typing import Any

from ..core.machine import Publish, blocks_key
from ..core.model import (
    Claim,
    DeadKey,
    DeadLetter,
    DeliveryRecord,
    Event,
    Outcome,
    State,
    Stats,
    make_claim,
)
from ..storekit import BatchBase, SettleItem, StoreBase
from .rows import (
    done_from_pairs,
    event_from_row,
    fold_stats,
    record_from_row,
    record_params,
    record_row,
    settle_row,
    still_owned,
)

__all__ = ["KeptRecords", "SQLBatch", "SQLStore"]

Row = Sequence[Any]

_CLAIM_ORDER = operator.itemgetter(6, 0)
"""A claimed row's ``(available_at, id)`` (``EVENT_COLUMNS``): the claim order."""


class SQLStore(StoreBase):
    """The operations of a SQL store (``StoreBase``'s required methods but ``enqueue``,
    ``transaction`` and ``delivery``, and faster ``get``, ``dead_letters`` and ``stats``); see
    the module docstring for the dialect seam."""

    settles_recording = False
    """Whether ``queries.sql`` has ``settle_many_recording`` (a batch's settlement and kept
    records in one statement; PostgreSQL's data-modifying CTE)."""

    payload_is_json = False
    """Whether the payload column only ever holds JSON (PostgreSQL's ``jsonb``): a claimed
    event's payload is then decoded on first read (``StoredJSON``), and a relay sends the
    text as it is."""

    # -- the dialect seam -------------------------------------------------------------------------

    @abstractmethod
    def _read(self, doing: str) -> AbstractContextManager[Any]:
        """A connection in a read transaction (one snapshot); driver errors mapped, naming
        ``doing``."""

    @abstractmethod
    def _write(self, doing: str) -> AbstractContextManager[Any]:
        """A connection in a short write transaction, committed when the block ends; driver
        errors mapped, naming ``doing``."""

    @abstractmethod
    def _mapped(self, doing: str, conn: Any = None) -> AbstractContextManager[None]:
        """A block whose driver errors become outboxkit's, naming ``doing`` (``conn``: the
        connection they happened on, when it tells more)."""

    @abstractmethod
    def _rows(self, conn: Any, name: str, params: Mapping[str, Any]) -> list[Row]:
        """Run the named statement on ``conn``; its rows (none for one that returns none)."""

    @abstractmethod
    def _instant(self, at: datetime | None) -> Any:
        """``at`` as the store binds an instant; None: the store's own clock."""

    @abstractmethod
    def _stored_instant(self, raw: Any) -> datetime:
        """A stored instant as an aware datetime."""

    @abstractmethod
    def _duration(self, delta: timedelta) -> Any:
        """``delta`` as the store binds a duration."""

    @abstractmethod
    def _array(self, values: Sequence[Any]) -> Any:
        """``values`` as the store binds an array parameter."""

    @abstractmethod
    def _done(self, raw: Any) -> Iterable[Sequence[str]]:
        """The claim statement's ``done`` column as (handler, outcome) pairs."""

    @abstractmethod
    def _settle_params(self, rows: Sequence[tuple[Any, ...]]) -> dict[str, Any]:
        """``settle_many``'s parameters (besides ``now``) for rows of ``SETTLE_COLUMNS``."""

    @abstractmethod
    def _records_params(self, rows: Sequence[tuple[Any, ...]]) -> dict[str, Any]:
        """``insert_records_fenced``'s parameters for rows of ``RECORD_COLUMNS``."""

    # -- claims and leases --------------------------------------------------------------------------
    # Each hot-path statement as a query to run and a mapping of its rows, so that the store's
    # asyncio side (``outboxkit._sql.aio``) runs the very same statements and mappings.

    def claim(
        self,
        *,
        batch_size: int,
        lease: timedelta,
        now: datetime | None,
        dead_key: DeadKey = "release",
    ) -> list[Claim]:
        """R3 (see ``Store.claim``)."""
        with self._write("claim events") as conn:
            return self._claims(
                self._rows(conn, *self._claim_query(batch_size, lease, now, dead_key))
            )

    def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        """R13 (see ``Deliveries.extend``)."""
        if not claims:
            return []
        with self._write(f"extend {len(claims)} lease(s)") as conn:
            return self._extend_on(conn, claims, lease, now)

    def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        """R8 for a round's events in one statement (see ``Deliveries.settle_many``)."""
        if not items:
            return []
        with self._write(f"settle {len(items)} event(s)") as conn:
            return self._settle_many_on(conn, items, now)

    def release(self, claims: Sequence[Claim], *, now: datetime | None) -> int:
        """Unstarted claims handed back: lease cleared, the attempt refunded, fenced by token."""
        if not claims:
            return 0
        with self._write(f"release {len(claims)} claim(s)") as conn:
            return len(self._rows(conn, *self._release_query(claims)))

    def _extend_on(
        self, conn: Any, claims: Sequence[Claim], lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        return self._extended(claims, self._rows(conn, *self._extend_query(claims, lease, now)))

    def _settle_many_on(
        self, conn: Any, items: Sequence[SettleItem], now: datetime | None
    ) -> list[bool]:
        return self._settled(items, self._rows(conn, *self._settle_many_query(items, now)))

    def _kept_query(self, kept: Sequence[tuple[Any, ...]]) -> tuple[str, dict[str, Any]]:
        """``insert_records_fenced`` for kept records (rows of ``RECORD_COLUMNS``)."""
        return "insert_records_fenced", self._records_params(kept)

    def _settle_kept_query(
        self, items: Sequence[SettleItem], kept: Sequence[tuple[Any, ...]], now: datetime | None
    ) -> tuple[str, dict[str, Any]] | None:
        """``settle_many_recording``: a batch's settlement and its kept records in one
        statement, when the store has it and every kept record is one of ``items``' events
        (the usual round); else None (the records go first, on their own)."""
        if not kept or not self.settles_recording:
            return None
        settling = {(claim.event.id, claim.token) for claim, _, _ in items}
        if not all((row[0], row[1]) in settling for row in kept):
            return None
        params = self._settle_many_params(items, now)
        records = self._records_params(kept)
        del records["tokens"]  # fenced by the settlement's own token check
        params["record_ids"] = records.pop("ids")
        params.update(records)
        return "settle_many_recording", params

    def _claim_query(
        self, batch_size: int, lease: timedelta, now: datetime | None, dead_key: DeadKey
    ) -> tuple[str, dict[str, Any]]:
        params = {
            "now": self._instant(now),
            "lease": self._duration(lease),
            "batch_size": batch_size,
            # R15: whether a dead event holds its key up (blocks_key's table, as a parameter).
            "hold": blocks_key(State.DEAD, dead_key),
        }
        return "claim", params

    def _claims(self, rows: Sequence[Row]) -> list[Claim]:
        """The claim's rows as claims, in claim order (R3/R5: oldest ``(available_at, id)``
        first; RETURNING has no order): the rows are sorted by those columns, then made into
        claims, positionally (one per row: it counts)."""
        event, done = self._event, self._done
        claims = []
        for row in sorted(rows, key=_CLAIM_ORDER):
            made = event(row)
            claims.append(
                make_claim(made, str(row[13]), made.locked_until, done_from_pairs(done(row[14])))
            )
        return claims

    def _extend_query(
        self, claims: Sequence[Claim], lease: timedelta, now: datetime | None
    ) -> tuple[str, dict[str, Any]]:
        ordered = sorted(claims, key=lambda c: c.event.id)  # one lock order for every poller
        return "extend", {
            "now": self._instant(now),
            "lease": self._duration(lease),
            "ids": self._array([c.event.id for c in ordered]),
            "tokens": self._array([c.token for c in ordered]),
        }

    def _extended(self, claims: Sequence[Claim], rows: Sequence[Row]) -> list[Claim]:
        ends = {str(token): self._stored_instant(end) for token, end in rows}
        return still_owned(claims, ends)

    def _settle_many_query(
        self, items: Sequence[SettleItem], now: datetime | None
    ) -> tuple[str, dict[str, Any]]:
        """``publish_many`` when every item publishes (two arrays, no CASE per row), else
        ``settle_many``."""
        if all(type(settlement) is Publish for _, settlement, _ in items):
            return "publish_many", {
                "now": self._instant(now),
                "ids": self._array([claim.event.id for claim, _, _ in items]),
                "tokens": self._array([claim.token for claim, _, _ in items]),
            }
        return "settle_many", self._settle_many_params(items, now)

    def _settle_many_params(
        self, items: Sequence[SettleItem], now: datetime | None
    ) -> dict[str, Any]:
        rows = [settle_row(c, s, e, self._duration) for c, s, e in items]
        return {"now": self._instant(now), **self._settle_params(rows)}

    @staticmethod
    def _settled(items: Sequence[SettleItem], rows: Sequence[Row]) -> list[bool]:
        settled = {row[0] for row in rows}
        return [claim.event.id in settled for claim, _, _ in items]

    def _release_query(self, claims: Sequence[Claim]) -> tuple[str, dict[str, Any]]:
        ordered = sorted(claims, key=lambda c: c.event.id)
        return "release", {
            "ids": self._array([c.event.id for c in ordered]),
            "tokens": self._array([c.token for c in ordered]),
        }

    # -- operations ---------------------------------------------------------------------------------

    def requeue(self, ids: Iterable[int], *, now: datetime | None) -> int:
        """R12: dead events due again with attempts reset; their records stay."""
        wanted = sorted(set(ids))
        if not wanted:
            return 0
        params = {"ids": self._array(wanted), "now": self._instant(now)}
        with self._write(f"requeue {len(wanted)} event(s)") as conn:
            return len(self._rows(conn, "requeue", params))

    def dead_letters(
        self, *, topic: str | None = None, since: datetime | None = None, limit: int = 100
    ) -> list[DeadLetter]:
        params = {
            "topic": topic,
            "since": None if since is None else self._instant(since),
            "limit": limit,
        }
        with self._read("list dead letters") as conn:
            rows = self._rows(conn, "dead_letters", params)
            records = self._records_of(conn, [row[0] for row in rows])
        return [
            DeadLetter(
                event=self._event(row),
                failed_at=self._stored_instant(row[9]),
                last_error=row[11],
                records=tuple(records.get(row[0], ())),
            )
            for row in rows
        ]

    def get(self, event_id: int) -> Event | None:
        with self._read(f"read event {event_id}") as conn:
            rows = self._rows(conn, "get", {"id": event_id})
        return self._event(rows[0]) if rows else None

    def events(
        self, *, after_id: int = 0, topic: str | None = None, limit: int = 1000
    ) -> list[Event]:
        params = {"after_id": after_id, "topic": topic, "limit": limit}
        with self._read("list events") as conn:
            rows = self._rows(conn, "events", params)
        return [self._event(row) for row in rows]

    def records(self, event_id: int) -> list[DeliveryRecord]:
        with self._read(f"read the records of event {event_id}") as conn:
            return self._records_of(conn, [event_id]).get(event_id, [])

    def _records_of(self, conn: Any, ids: Sequence[int]) -> dict[int, list[DeliveryRecord]]:
        found: dict[int, list[DeliveryRecord]] = {}
        if ids:
            for row in self._rows(conn, "records", {"ids": self._array(ids)}):
                record = record_from_row(row, self._stored_instant)
                found.setdefault(record.event_id, []).append(record)
        return found

    def purge_published(self, *, before: datetime, limit: int) -> int:
        params = {"before": self._instant(before), "limit": limit}
        with self._write("purge published events") as conn:
            return len(self._rows(conn, "purge_published", params))

    def purge_dead(
        self, *, ids: Iterable[int] | None = None, before: datetime | None = None, limit: int
    ) -> int:
        params = {
            "ids": None if ids is None else self._array(sorted(set(ids))),
            "before": None if before is None else self._instant(before),
            "limit": limit,
        }
        with self._write("purge dead events") as conn:
            return len(self._rows(conn, "purge_dead", params))

    def stats(self, *, now: datetime | None) -> Stats:
        with self._read("count events") as conn:
            rows = self._rows(conn, "stats", {"now": self._instant(now)})
        return fold_stats(rows, self._stored_instant)

    def _event(self, row: Row) -> Event:
        return event_from_row(row, self._stored_instant, json_column=self.payload_is_json)


class KeptRecords:
    """The records of a batch's deliveries that never opened their savepoint (their handler
    did not use the connection): written together, fenced by token, with or just before the
    batch's settlement. Both sides' batches keep them so."""

    def __init__(self) -> None:
        self._kept: list[tuple[Any, ...]] = []

    def keep(self, claim: Claim, params: Mapping[str, Any]) -> None:
        """Keep a delivery's record (``record_params``) for the batch's settlement."""
        self._kept.append(record_row(claim, params))

    def _take_kept(self) -> list[tuple[Any, ...]]:
        rows, self._kept = self._kept, []
        return rows

    def _keep_succeeded(
        self, store: SQLStore, handler: str, claims: Sequence[Claim], now: Any
    ) -> None:
        """Keep a succeeded record of ``handler`` for each of ``claims`` (``record_many``)."""
        at = store._instant(now)
        succeeded = Outcome.SUCCEEDED
        self._kept.extend(
            record_row(claim, record_params(claim, handler, succeeded, None, at))
            for claim in claims
        )


class SQLBatch(KeptRecords, BatchBase):
    """What a SQL store's batch transaction (``Store.batch``) does the same way: lease
    extensions and the round's ``settle_many``, on the batch's connection (another one would
    wait for the batch's own locks). Its ``delivery`` (a savepoint) is the store's own."""

    def __init__(self, store: SQLStore, conn: Any) -> None:
        super().__init__()
        self._store = store
        self._conn = conn

    def write_kept(self) -> None:
        """Write the kept records in one statement, each fenced by its claim's token (a stale
        one writes nothing: its event's settlement finds the token stale too)."""
        if not self._kept:
            return
        rows = self._take_kept()
        self._check_open()
        with self._store._mapped(f"record {len(rows)} deliveries", self._conn):
            self._store._rows(self._conn, *self._store._kept_query(rows))

    def _check_open(self) -> None:
        """Raise if the batch's transaction is no longer the one the store opened."""

    def _begin(self) -> None:
        """Make sure the batch's transaction has begun (a store whose batches begin it
        lazily: the PostgreSQL store's); a store whose batches begin at once does nothing."""

    def record_many(
        self, handler: str, claims: Sequence[Claim], *, now: datetime | None
    ) -> list[bool]:
        """``BatchTransaction.record_many``: the records are kept, written fenced by token with
        the batch's settlement (as the deliveries that never took the connection keep theirs)."""
        self._check_open()
        self._keep_succeeded(self._store, handler, claims, now)
        return [True] * len(claims)

    def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        if not claims:
            return []
        self._check_open()
        self._begin()
        with self._store._mapped(f"extend {len(claims)} lease(s)", self._conn):
            return self._store._extend_on(self._conn, claims, lease, now)

    def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        """``settle_many`` inside the batch's transaction: true once the batch commits.

        The kept records go first (``write_kept``) or, on a store with ``settle_many_recording``
        and when every kept record is one of these events' (the usual round), with the
        settlement in one statement."""
        self._check_open()
        self._begin()
        return self._settle(items, now)

    def settle_last(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        """``BatchTransaction.settle_last``: ``settle_many``, but a batch not begun yet (nothing
        written in it) begins only for a settlement of more than one statement; one statement
        is then a transaction of its own, and the block's end has nothing to commit."""
        self._check_open()
        return self._settle(items, now)

    def _settle(self, items: Sequence[SettleItem], now: datetime | None) -> list[bool]:
        if not items:
            self.write_kept()
            return []
        store = self._store
        together = store._settle_kept_query(items, self._kept, now)
        if together is not None:
            self._kept = []
            with store._mapped(f"settle and record {len(items)} event(s)", self._conn):
                return store._settled(items, store._rows(self._conn, *together))
        if self._kept:
            self._begin()  # the records and the settlement: one transaction
        self.write_kept()
        with store._mapped(f"settle {len(items)} event(s)", self._conn):
            return store._settle_many_on(self._conn, items, now)
