"""The SQL store seam: a SQL database is one ``queries.sql`` of named statements and a dialect.

``SQLStore`` writes the operations every SQL store shares once - claim, extend, settle,
release, requeue, the listings, the purges, the stats - from the statements of the store's
``queries.sql`` (``load_queries``), and asks its ``Dialect`` for what differs between
databases: its connections and transactions, how its driver's errors map to outboxkit's, and
how it binds and reads instants, durations and arrays. A store subclasses ``SQLStore`` with a
dialect of its own and adds what is its own: ``enqueue`` through the app's connection, its
``transaction``, its delivery transaction (``delivery``), its batch (``batch``, a ``SQLBatch``)
and its migrations. Helpers of a store get the dialect, an object with public members; nothing
reads the store's private state.

``queries.sql`` holds these statements, with these parameters (identifiers are the store's,
filled in before the statements are run; values are always bound):

=============== ============================================ ============================
statement       parameters                                   returns
=============== ============================================ ============================
claim           now, lease, batch_size, hold                 EVENT_COLUMNS, token, done
extend          now, lease, ids, tokens                      token, locked_until
settle_many     now, and the dialect's shape of SETTLE_COLUMNS id
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

``publish_many`` is ``settle_many`` for the usual round, in which every event is published: the
ids and the tokens alone (``Statements.settle_many``). A dialect whose ``settles_recording`` is
true also has ``settle_many_recording`` (settle_many's parameters plus
``insert_records_fenced``'s, ``ids`` renamed ``record_ids``, no ``tokens``), returning the ids
settled: a batch's settlement and its kept records in one statement.

Each write is one of the machine's transitions (``outboxkit.core.machine.TRANSITIONS``): ``claim``
is CLAIM, ``release`` RELEASE, ``requeue`` REQUEUE, and ``settle_many`` writes the state
``settlement.state`` gives (PUBLISH, RETRY or DEAD_LETTER, see ``rows.settle_row``); a lease
running out (LEASE_EXPIRE) is no write at all.

The asyncio side of a SQL store (``AsyncSQLStore``) runs the very same statements, built and
read by the store's ``Statements``: only its connections and the waiting are its own.
"""

from __future__ import annotations

import json
import operator
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from typing import Any

from ..core.machine import Publish, blocks_key
from ..core.model import (
    AttemptError,
    Claim,
    DeadKey,
    DeadLetter,
    DeliveryRecord,
    Event,
    Migration,
    Outcome,
    State,
    Stats,
    make_claim,
)
from ..errors import ConfigurationError, SchemaError
from ..store import SettleItem
from .bases import BatchBase, StoreBase
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

__all__ = [
    "Dialect",
    "KeptRecords",
    "Query",
    "Row",
    "SQLBatch",
    "SQLStore",
    "Statements",
]

Row = Sequence[Any]
"""One row a statement returned."""

Query = tuple[str, dict[str, Any]]
"""A statement to run: its name in ``queries.sql``, and its parameters."""

_CLAIM_ORDER = operator.itemgetter(6, 0)
"""A claimed row's ``(available_at, id)`` (``EVENT_COLUMNS``): the claim order."""


class Dialect(ABC):
    """What differs between SQL databases, for ``SQLStore`` (see the module docstring).

    Attributes:
        name: the database's name as SQLAlchemy knows it (``"postgresql"``, ``"sqlite"``,
            ``"mysql"``).
        where: the database, for messages (never a password).
        payload_is_json: the payload column only ever holds JSON (PostgreSQL's ``jsonb``): a
            claimed event's payload is then decoded on first read, and a relay sends the
            stored text as it is.
        settles_recording: ``queries.sql`` has ``settle_many_recording``.
    """

    name: str = ""
    where: str = ""
    payload_is_json: bool = False
    settles_recording: bool = False

    # -- connections ----------------------------------------------------------------------------

    @abstractmethod
    def read(self, doing: str) -> AbstractContextManager[Any]:
        """A connection to read on (one snapshot for the block); driver errors mapped,
        naming ``doing``."""

    @abstractmethod
    def write(self, doing: str) -> AbstractContextManager[Any]:
        """A connection in a short write transaction, committed when the block ends (rolled
        back if it raises); driver errors mapped, naming ``doing``."""

    @abstractmethod
    def mapped(self, doing: str, conn: Any = None) -> AbstractContextManager[None]:
        """A block whose driver errors become outboxkit's (``StoreError``, ``StoreUnavailable``
        for an outage that may pass), naming ``doing`` (``conn``: the connection they happened
        on, when it tells more)."""

    @abstractmethod
    def rows(self, conn: Any, name: str, params: Mapping[str, Any]) -> list[Row]:
        """Run the named statement of ``queries.sql`` on ``conn``; its rows (none for one that
        returns none)."""

    def close(self) -> None:
        """Close the dialect's connections (``SQLStore.close``). By default nothing."""
        return None

    # -- values ---------------------------------------------------------------------------------

    def instant(self, at: datetime | None) -> Any:
        """``at`` as the database binds an instant (None: its own clock, where the statements
        fall back to it). By default an aware datetime, as it is."""
        return at

    def stored_instant(self, raw: Any) -> datetime:
        """A stored instant as an aware datetime. By default what the driver returned."""
        instant: datetime = raw
        return instant

    def duration(self, delta: timedelta) -> Any:
        """``delta`` as the database binds a duration. By default a ``timedelta``."""
        return delta

    def array(self, values: Sequence[Any]) -> Any:
        """``values`` as the database binds a list parameter. By default a list."""
        return list(values)

    def done(self, raw: Any) -> Iterable[Sequence[str]]:
        """The claim statement's ``done`` column as (handler, outcome) pairs. By default the
        value itself (None: no earlier record)."""
        pairs: Iterable[Sequence[str]] = raw or []
        return pairs

    @abstractmethod
    def settle_params(self, rows: Sequence[tuple[Any, ...]]) -> dict[str, Any]:
        """``settle_many``'s parameters (besides ``now``) for rows of ``SETTLE_COLUMNS``."""

    @abstractmethod
    def records_params(self, rows: Sequence[tuple[Any, ...]]) -> dict[str, Any]:
        """``insert_records_fenced``'s parameters for rows of ``RECORD_COLUMNS``."""


class JSONRows:
    """The values of a database without arrays or intervals (a ``Dialect`` mixin, before
    ``Dialect``): durations as integer microseconds, the claim's ``done`` as JSON text of
    (handler, outcome) pairs, and the rows of ``settle_many`` and ``insert_records_fenced`` as
    JSON text, ``%(items)s`` (instants in them as ISO text)."""

    def duration(self, delta: timedelta) -> Any:
        return delta // _MICROSECOND

    def done(self, raw: Any) -> Iterable[Sequence[str]]:
        if not raw or raw == "[]":  # no records: nearly every claim's first
            return ()
        pairs: list[Sequence[str]] = json.loads(raw)
        return pairs

    def settle_params(self, rows: Sequence[tuple[Any, ...]]) -> dict[str, Any]:
        return {"items": json.dumps(rows)}

    def records_params(self, rows: Sequence[tuple[Any, ...]]) -> dict[str, Any]:
        return {"items": json.dumps(rows, default=_iso_instant)}


class NaiveUTC:
    """Instants of a database whose timestamps have no zone (a ``Dialect`` mixin, before
    ``Dialect``): bound as naive datetimes in UTC (None as it is: the database's clock), read
    back aware."""

    def instant(self, at: datetime | None) -> Any:
        if at is None:
            return None
        if at.tzinfo is None or at.utcoffset() is None:
            raise ConfigurationError(f"instants must be timezone-aware, got {at!r}")
        return at.astimezone(UTC).replace(tzinfo=None)

    def stored_instant(self, raw: Any) -> datetime:
        instant: datetime = raw.replace(tzinfo=UTC)
        return instant


_MICROSECOND = timedelta(microseconds=1)


def _iso_instant(value: Any) -> str:
    if isinstance(value, datetime):
        return value.isoformat(sep=" ")
    raise TypeError(f"not JSON: {type(value).__name__}")


class Statements:
    """The statements of the shared operations, built (``*_query``: a ``Query``) and their rows
    read back (the other methods), once for both sides of a store. A store may subclass it to
    pick a faster statement (``settle_kept``)."""

    def __init__(self, dialect: Dialect) -> None:
        self.dialect = dialect

    def event(self, row: Row) -> Event:
        """An event from a row of ``EVENT_COLUMNS``."""
        dialect = self.dialect
        return event_from_row(row, dialect.stored_instant, json_column=dialect.payload_is_json)

    # -- claims and leases --------------------------------------------------------------------

    def claim_query(
        self, batch_size: int, lease: timedelta, now: datetime | None, dead_key: DeadKey
    ) -> Query:
        dialect = self.dialect
        return "claim", {
            "now": dialect.instant(now),
            "lease": dialect.duration(lease),
            "batch_size": batch_size,
            # R15: whether a dead event holds its key up (blocks_key's table, as a parameter).
            "hold": blocks_key(State.DEAD, dead_key),
        }

    def claims(self, rows: Sequence[Row]) -> list[Claim]:
        """The claim's rows as claims, in claim order (R3/R5: oldest ``(available_at, id)``
        first; RETURNING has no order): the rows sorted by those columns, then made into
        claims (the token and the done pairs after ``EVENT_COLUMNS``)."""
        event, done = self.event, self.dialect.done
        claims = []
        for row in sorted(rows, key=_CLAIM_ORDER):
            made = event(row)
            claims.append(
                make_claim(made, str(row[13]), made.locked_until, done_from_pairs(done(row[14])))
            )
        return claims

    def extend_query(
        self, claims: Sequence[Claim], lease: timedelta, now: datetime | None
    ) -> Query:
        dialect = self.dialect
        ordered = sorted(claims, key=lambda c: c.event.id)  # one lock order for every poller
        return "extend", {
            "now": dialect.instant(now),
            "lease": dialect.duration(lease),
            "ids": dialect.array([c.event.id for c in ordered]),
            "tokens": dialect.array([c.token for c in ordered]),
        }

    def extended(self, claims: Sequence[Claim], rows: Sequence[Row]) -> list[Claim]:
        ends = {str(token): self.dialect.stored_instant(end) for token, end in rows}
        return still_owned(claims, ends)

    def release_query(self, claims: Sequence[Claim]) -> Query:
        dialect = self.dialect
        ordered = sorted(claims, key=lambda c: c.event.id)
        return "release", {
            "ids": dialect.array([c.event.id for c in ordered]),
            "tokens": dialect.array([c.token for c in ordered]),
        }

    # -- settlements ----------------------------------------------------------------------------

    def settle_many_query(self, items: Sequence[SettleItem], now: datetime | None) -> Query:
        """``publish_many`` when every item publishes (two arrays, no CASE per row), else
        ``settle_many``."""
        dialect = self.dialect
        if all(type(settlement) is Publish for _, settlement, _ in items):
            return "publish_many", {
                "now": dialect.instant(now),
                "ids": dialect.array([claim.event.id for claim, _, _ in items]),
                "tokens": dialect.array([claim.token for claim, _, _ in items]),
            }
        return "settle_many", self.settle_many_params(items, now)

    def settle_many_params(
        self, items: Sequence[SettleItem], now: datetime | None
    ) -> dict[str, Any]:
        dialect = self.dialect
        rows = [settle_row(c, s, e, dialect.duration) for c, s, e in items]
        return {"now": dialect.instant(now), **dialect.settle_params(rows)}

    @staticmethod
    def settled(items: Sequence[SettleItem], rows: Sequence[Row]) -> list[bool]:
        """Which of ``items`` the statement settled (the ids it returned)."""
        settled = {row[0] for row in rows}
        return [claim.event.id in settled for claim, _, _ in items]

    def kept_query(self, kept: Sequence[tuple[Any, ...]]) -> Query:
        """``insert_records_fenced`` for kept records (rows of ``RECORD_COLUMNS``)."""
        return "insert_records_fenced", self.dialect.records_params(kept)

    def settle_kept(
        self, items: Sequence[SettleItem], kept: Sequence[tuple[Any, ...]], now: datetime | None
    ) -> Query | None:
        """``settle_many_recording``: a batch's settlement and its kept records in one
        statement, when the dialect has it and every kept record is one of ``items``' events
        (the usual round); else None (the records go first, on their own)."""
        if not kept or not self.dialect.settles_recording:
            return None
        settling = {(claim.event.id, claim.token) for claim, _, _ in items}
        if not all((row[0], row[1]) in settling for row in kept):
            return None
        params = self.settle_many_params(items, now)
        records = self.dialect.records_params(kept)
        del records["tokens"]  # fenced by the settlement's own token check
        params["record_ids"] = records.pop("ids")
        params.update(records)
        return "settle_many_recording", params


class SQLStore(StoreBase):
    """The operations every SQL store shares (``StoreBase``'s required methods but ``enqueue``,
    ``transaction`` and ``delivery``, and faster ``get``, ``dead_letters`` and ``stats``), on
    ``dialect`` (see the module docstring).

    Args:
        dialect: the database's dialect.
        statements: the statements' builder (default: ``Statements(dialect)``).
    """

    schema_version = 0
    """The newest schema version this store's code knows (``migrate``); 0: none."""

    def __init__(self, dialect: Dialect, statements: Statements | None = None) -> None:
        self.dialect = dialect
        self.statements = statements if statements is not None else Statements(dialect)

    # -- schema and clock -----------------------------------------------------------------------

    def migrate(self) -> Migration | None:
        """Bring the schema to ``schema_version`` (None when that is 0): ``create_versions``
        (idempotent) makes the table of applied versions, ``schema_version`` reads the highest
        (0: none), and each ``migration_N`` above it runs in order, ``record_version`` noting
        ``version`` N after it. The statements of ``queries.sql`` must bear being run by two
        processes at once (``IF NOT EXISTS``, an ignored duplicate version), or
        ``create_versions`` must take a lock until the transaction ends.

        Raises:
            SchemaError: the database's schema is newer than this code.
            StoreError: the database failed.
        """
        newest, dialect = self.schema_version, self.dialect
        if not newest:
            return None
        with dialect.write("migrate the schema") as conn:
            dialect.rows(conn, "create_versions", {})
            ((found,),) = dialect.rows(conn, "schema_version", {})
            if found > newest:
                raise SchemaError(
                    f"{dialect.where} has outboxkit schema version {found}, newer than version "
                    f"{newest} this outboxkit knows: upgrade outboxkit"
                )
            for version in range(found + 1, newest + 1):
                dialect.rows(conn, f"migration_{version}", {})
                dialect.rows(conn, "record_version", {"version": version})
        return Migration(before=found, after=max(found, newest))

    def now(self) -> datetime:
        """With ``capabilities.database_clock``, the database's clock (``clock``: one row, one
        instant); else this host's (``StoreBase.now``).

        Raises:
            StoreError: the database failed.
        """
        if not self.capabilities.database_clock:
            return super().now()
        with self.dialect.read("read the database clock") as conn:
            ((at,),) = self.dialect.rows(conn, "clock", {})
        return self.dialect.stored_instant(at)

    def close(self) -> None:
        """Close the dialect's connections (``Dialect.close``)."""
        self.dialect.close()

    # -- claims and leases ----------------------------------------------------------------------

    def claim(
        self,
        *,
        batch_size: int,
        lease: timedelta,
        now: datetime | None,
        dead_key: DeadKey = "release",
    ) -> list[Claim]:
        """R3 (see ``Store.claim``)."""
        statements = self.statements
        with self.dialect.write("claim events") as conn:
            rows = self.dialect.rows(
                conn, *statements.claim_query(batch_size, lease, now, dead_key)
            )
        return statements.claims(rows)

    def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        """R13 (see ``Deliveries.extend``)."""
        if not claims:
            return []
        with self.dialect.write(f"extend {len(claims)} lease(s)") as conn:
            return self.extend_on(conn, claims, lease, now)

    def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        """R8 for a round's events in one statement (see ``Deliveries.settle_many``)."""
        if not items:
            return []
        with self.dialect.write(f"settle {len(items)} event(s)") as conn:
            return self.settle_many_on(conn, items, now)

    def release(self, claims: Sequence[Claim], *, now: datetime | None) -> int:
        """Unstarted claims handed back: lease cleared, the attempt refunded, fenced by token."""
        if not claims:
            return 0
        with self.dialect.write(f"release {len(claims)} claim(s)") as conn:
            return len(self.dialect.rows(conn, *self.statements.release_query(claims)))

    def extend_on(
        self, conn: Any, claims: Sequence[Claim], lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        """``extend`` on ``conn``, in the transaction open on it (a batch's)."""
        statements = self.statements
        rows = self.dialect.rows(conn, *statements.extend_query(claims, lease, now))
        return statements.extended(claims, rows)

    def settle_many_on(
        self, conn: Any, items: Sequence[SettleItem], now: datetime | None
    ) -> list[bool]:
        """``settle_many`` on ``conn``, in the transaction open on it (a batch's)."""
        statements = self.statements
        rows = self.dialect.rows(conn, *statements.settle_many_query(items, now))
        return statements.settled(items, rows)

    # -- operations -----------------------------------------------------------------------------

    def requeue(self, ids: Iterable[int], *, now: datetime | None) -> int:
        """R12: dead events due again with attempts reset; their records stay."""
        wanted = sorted(set(ids))
        if not wanted:
            return 0
        dialect = self.dialect
        params = {"ids": dialect.array(wanted), "now": dialect.instant(now)}
        with dialect.write(f"requeue {len(wanted)} event(s)") as conn:
            return len(dialect.rows(conn, "requeue", params))

    def dead_letters(
        self, *, topic: str | None = None, since: datetime | None = None, limit: int = 100
    ) -> list[DeadLetter]:
        dialect = self.dialect
        params = {
            "topic": topic,
            "since": None if since is None else dialect.instant(since),
            "limit": limit,
        }
        with dialect.read("list dead letters") as conn:
            rows = dialect.rows(conn, "dead_letters", params)
            records = self.records_of(conn, [row[0] for row in rows])
        event = self.statements.event
        return [
            DeadLetter(
                event=event(row),
                failed_at=dialect.stored_instant(row[9]),
                last_error=row[11],
                records=tuple(records.get(row[0], ())),
            )
            for row in rows
        ]

    def get(self, event_id: int) -> Event | None:
        with self.dialect.read(f"read event {event_id}") as conn:
            rows = self.dialect.rows(conn, "get", {"id": event_id})
        return self.statements.event(rows[0]) if rows else None

    def events(
        self, *, after_id: int = 0, topic: str | None = None, limit: int = 1000
    ) -> list[Event]:
        params = {"after_id": after_id, "topic": topic, "limit": limit}
        with self.dialect.read("list events") as conn:
            rows = self.dialect.rows(conn, "events", params)
        return [self.statements.event(row) for row in rows]

    def records(self, event_id: int) -> list[DeliveryRecord]:
        with self.dialect.read(f"read the records of event {event_id}") as conn:
            return self.records_of(conn, [event_id]).get(event_id, [])

    def attempt_errors(self, event_id: int) -> list[AttemptError]:
        """The ``attempt_errors`` statement's rows (attempt, stored instant, error), oldest
        first, on a store declaring ``capabilities.error_history``; else none."""
        if not self.capabilities.error_history:
            return []
        dialect = self.dialect
        with dialect.read(f"read the errors of event {event_id}") as conn:
            rows = dialect.rows(conn, "attempt_errors", {"id": event_id})
        return [AttemptError(int(n), dialect.stored_instant(at), str(e)) for n, at, e in rows]

    def records_of(self, conn: Any, ids: Sequence[int]) -> dict[int, list[DeliveryRecord]]:
        """The records of the events ``ids``, read on ``conn``, by event id."""
        found: dict[int, list[DeliveryRecord]] = {}
        if ids:
            dialect = self.dialect
            for row in dialect.rows(conn, "records", {"ids": dialect.array(ids)}):
                record = record_from_row(row, dialect.stored_instant)
                found.setdefault(record.event_id, []).append(record)
        return found

    def purge_published(self, *, before: datetime, limit: int) -> int:
        dialect = self.dialect
        params = {"before": dialect.instant(before), "limit": limit}
        with dialect.write("purge published events") as conn:
            return len(dialect.rows(conn, "purge_published", params))

    def purge_dead(
        self, *, ids: Iterable[int] | None = None, before: datetime | None = None, limit: int
    ) -> int:
        dialect = self.dialect
        params = {
            "ids": None if ids is None else dialect.array(sorted(set(ids))),
            "before": None if before is None else dialect.instant(before),
            "limit": limit,
        }
        with dialect.write("purge dead events") as conn:
            return len(dialect.rows(conn, "purge_dead", params))

    def stats(self, *, now: datetime | None) -> Stats:
        dialect = self.dialect
        with dialect.read("count events") as conn:
            rows = dialect.rows(conn, "stats", {"now": dialect.instant(now)})
        return fold_stats(rows, dialect.stored_instant)


class KeptRecords:
    """The records of a batch's deliveries that never opened their savepoint (their handler
    did not use the connection): written together, fenced by token, with or just before the
    batch's settlement. Both sides' batches keep them so."""

    def __init__(self) -> None:
        self.kept: list[tuple[Any, ...]] = []

    def keep(self, claim: Claim, params: Mapping[str, Any]) -> None:
        """Keep a delivery's record (``rows.record_params``) for the batch's settlement."""
        self.kept.append(record_row(claim, params))

    def take_kept(self) -> list[tuple[Any, ...]]:
        """The kept records, taken."""
        rows, self.kept = self.kept, []
        return rows

    def keep_succeeded(
        self, dialect: Dialect, handler: str, claims: Sequence[Claim], now: datetime | None
    ) -> None:
        """Keep a succeeded record of ``handler`` for each of ``claims`` (``record_many``)."""
        at = dialect.instant(now)
        succeeded = Outcome.SUCCEEDED
        self.kept.extend(
            record_row(claim, record_params(claim, handler, succeeded, None, at))
            for claim in claims
        )


class SQLBatch(KeptRecords, BatchBase):
    """What a SQL store's batch transaction (``Store.batch``) does the same way: lease
    extensions and the round's ``settle_many``, on the batch's connection (another one would
    wait for the batch's own locks). Its ``delivery`` (a savepoint) is the store's own.

    Args:
        store: the store.
        conn: the batch's connection, in its transaction (or, for a store whose batches begin
            lazily, before it: ``begin``).
    """

    def __init__(self, store: SQLStore, conn: Any) -> None:
        super().__init__()
        self.store = store
        self.conn = conn
        self.claims: Sequence[Claim] = ()
        self.owned: dict[str, bool] | None = None  # by token, once ``lock`` asked the database

    def claimed(self, claims: Sequence[Claim]) -> None:
        """``BatchTransaction.claimed``: the claims, kept for ``lock``."""
        self.claims = claims

    def lock(self, claim: Claim) -> bool | None:
        """Whether the batch holds ``claim``'s row (None: a claim it was not told of, to check
        on its own), for a store whose ``queries.sql`` has ``lock_claimed`` (``ids``,
        ``tokens``: the ids of the rows whose tokens hold, locked). At the first call, the
        tokens of the claims told (``claimed``) are checked and their rows locked, all at
        once (R6): a delivery of one of them then checks nothing (its row stays locked until
        the batch ends); one of the others is refused without asking the database."""
        if self.owned is None and self.claims:
            ids, tokens = zip(*((c.event.id, c.token) for c in self.claims), strict=True)
            dialect = self.store.dialect
            params = {"ids": dialect.array(ids), "tokens": dialect.array(tokens)}
            with dialect.mapped("lock the batch's events", self.conn):
                rows = dialect.rows(self.conn, "lock_claimed", params)
            held = {row[0] for row in rows}
            self.owned = {c.token: c.event.id in held for c in self.claims}
        return None if self.owned is None else self.owned.get(claim.token)

    def check_open(self) -> None:
        """Raise if the batch's transaction is no longer the one the store opened (by default
        nothing is checked)."""

    def begin(self) -> None:
        """Make sure the batch's transaction has begun (a store whose batches begin it lazily,
        as the PostgreSQL store's); by default it began with the batch."""

    def write_kept(self) -> None:
        """Write the kept records in one statement, each fenced by its claim's token (a stale
        one writes nothing: its event's settlement finds the token stale too)."""
        if not self.kept:
            return
        rows = self.take_kept()
        self.check_open()
        store = self.store
        with store.dialect.mapped(f"record {len(rows)} deliveries", self.conn):
            store.dialect.rows(self.conn, *store.statements.kept_query(rows))

    def record_many(
        self, handler: str, claims: Sequence[Claim], *, now: datetime | None
    ) -> list[bool]:
        """``BatchTransaction.record_many``: the records are kept, written fenced by token with
        the batch's settlement (as the deliveries that never took the connection keep theirs)."""
        self.check_open()
        self.keep_succeeded(self.store.dialect, handler, claims, now)
        return [True] * len(claims)

    def extend(
        self, claims: Sequence[Claim], *, lease: timedelta, now: datetime | None
    ) -> list[Claim]:
        if not claims:
            return []
        self.check_open()
        self.begin()
        with self.store.dialect.mapped(f"extend {len(claims)} lease(s)", self.conn):
            return self.store.extend_on(self.conn, claims, lease, now)

    def settle_many(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        """``settle_many`` inside the batch's transaction: true once the batch commits. The
        kept records go first (``write_kept``), or with the settlement in one statement
        (``Statements.settle_kept``)."""
        self.check_open()
        self.begin()
        return self.settle(items, now)

    def settle_last(self, items: Sequence[SettleItem], *, now: datetime | None) -> list[bool]:
        """``BatchTransaction.settle_last``: ``settle_many``, but a batch not begun yet (nothing
        written in it) begins only for a settlement of more than one statement; one statement
        is then a transaction of its own, and the block's end has nothing to commit."""
        self.check_open()
        return self.settle(items, now)

    def settle(self, items: Sequence[SettleItem], now: datetime | None) -> list[bool]:
        """The settlement with the kept records (see ``settle_many``), on the batch's
        connection."""
        if not items:
            self.write_kept()
            return []
        store = self.store
        dialect, statements = store.dialect, store.statements
        together = statements.settle_kept(items, self.kept, now)
        if together is not None:
            self.kept = []
            with dialect.mapped(f"settle and record {len(items)} event(s)", self.conn):
                return statements.settled(items, dialect.rows(self.conn, *together))
        if self.kept:
            self.begin()  # the records and the settlement: one transaction
        self.write_kept()
        with dialect.mapped(f"settle {len(items)} event(s)", self.conn):
            return store.settle_many_on(self.conn, items, now)
