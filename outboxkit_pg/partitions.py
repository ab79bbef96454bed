"""The partitioned layout (``PostgresStore(..., partition_size=N)``): bounded tables on
PostgreSQL, where retention drops whole partitions instead of deleting rows.

The events and the delivery records are partitioned by event id, in ranges of ``partition_size``
ids, with the same bounds (an event and its records are dropped together). Ids are handed out in
time order, so each range is a stretch of time; a partition whose every event was published
before the retention's cutoff is detached (``DETACH ... CONCURRENTLY``: claims and enqueues
never wait for it) and dropped, which leaves no dead tuples for vacuum and costs the same for a
partition of ten events or of ten million. A partition holding a pending event or a dead letter
stays until those are gone; the rows of the partitions that cannot go yet are pruned by
``DELETE`` as in the other layout.

Why by id and not by a timestamp: the primary key, the records' key and every statement of
``queries.sql`` stay as they are (a unique index of a partitioned table must hold the partition
key, and ``id`` is in every one of them), and a claim's ``UPDATE ... WHERE id = ANY(...)`` finds
its partition by the key itself. What it costs: the dedupe keys (their unique index would have to
hold the id too), so this layout does not declare ``capabilities.dedupe``.

Partitions are made ahead of the ids: ``ahead`` of them above the one the newest event is in, by
``migrate()`` and by every ``purge_published`` (the pollers' retention runs it once a minute).
An enqueue that found no partition for its id fails (nothing written, the app's transaction
rolled back) with a message saying to run maintenance; ``outboxkit doctor`` reports a store
short of partitions ahead.
"""

from __future__ import annotations

import logging
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from outboxkit.errors import ConfigurationError
from outboxkit.storekit.queries import load_queries, split_steps

from .names import Names, index_name

if TYPE_CHECKING:
    from .store import PostgresStore

__all__ = [
    "AHEAD",
    "Partition",
    "check_partition_size",
    "convert",
    "maintain",
    "newest_id",
    "partitions",
]

log = logging.getLogger("outboxkit")

AHEAD = 3
"""Partitions kept ready above the one holding the newest event."""

_LOCK_SPACE = 0x6F70  # first key of the maintenance's advisory lock: "op"

_NUMBER = re.compile(r"_p(\d+)$")
_BOUND = re.compile(r"FROM \((MINVALUE|'?(-?\d+)'?)\) TO \((MAXVALUE|'?(-?\d+)'?)\)")


def check_partition_size(size: object) -> int:
    """``size`` if it is an integer from 10 to 10**12.

    Raises:
        ConfigurationError: naming the bad value.
    """
    if isinstance(size, bool) or not isinstance(size, int) or not 10 <= size <= 10**12:
        raise ConfigurationError(
            f"partition_size must be an integer from 10 to 10**12 (event ids per partition), "
            f"got {size!r}"
        )
    return size


@dataclass(frozen=True, slots=True)
class Partition:
    """One range of event ids: its events' and records' partitions share it.

    Attributes:
        number: the range's number (its lower bound over the size; 0 for the first, which
            starts at the lowest id there is).
        lower: the lowest id it holds (None: no lower bound).
        upper: one above the highest id it holds.
        detaching: a ``DETACH ... CONCURRENTLY`` of it was interrupted.
    """

    number: int
    lower: int | None
    upper: int
    detaching: bool = False


def _slots(names: Names, part: Partition | None = None) -> dict[str, sql.Composable]:
    slots: dict[str, sql.Composable] = dict(names.slots())
    schema = names.schema
    slots["events_seq"] = sql.Identifier(schema, index_name(names.events, "id_seq"))
    slots["records_seq"] = sql.Identifier(schema, index_name(names.deliveries, "seq_seq"))
    if part is not None:
        events_part = index_name(names.events, f"p{part.number}")
        records_part = index_name(names.deliveries, f"p{part.number}")
        slots["partition"] = sql.Identifier(schema, events_part)
        slots["records_partition"] = sql.Identifier(schema, records_part)
        slots["partition_name"] = sql.Identifier(events_part)
        slots["records_partition_name"] = sql.Identifier(records_part)
        slots["lower"] = sql.SQL("MINVALUE") if part.lower is None else sql.Literal(part.lower)
        slots["upper"] = sql.Literal(part.upper)
    return slots


def _run(
    conn: psycopg.Connection[Any],
    name: str,
    slots: Mapping[str, sql.Composable],
    params: Mapping[str, Any] | None = None,
) -> list[tuple[Any, ...]]:
    """Run statement ``name`` of ``partitions.sql`` (step by step when it has several) with
    ``slots`` filled; the last step's rows."""
    rows: list[tuple[Any, ...]] = []
    for step in split_steps(load_queries("outboxkit_pg", "partitions.sql")[name]):
        with conn.cursor() as cur:
            cur.execute(sql.SQL(step).format(**slots), params or None)
            if cur.description is not None:
                rows = cur.fetchall()
    return rows


def partitions(conn: psycopg.Connection[Any], names: Names) -> list[Partition]:
    """The events table's partitions, lowest range first (none: not partitioned)."""
    found = []
    for relname, bound, pending in _run(conn, "partitions", names.slots()):
        match, number = _BOUND.search(bound), _NUMBER.search(relname)
        if match is None or number is None:
            continue  # not one of ours (a partition attached by hand): left alone
        if relname != index_name(names.events, f"p{number.group(1)}"):
            continue
        lower = None if match.group(2) is None else int(match.group(2))
        upper = int(match.group(4)) if match.group(4) is not None else 2**63 - 1
        found.append(Partition(int(number.group(1)), lower, upper, bool(pending)))
    return sorted(found, key=lambda p: (p.lower is not None, p.lower or 0))


def newest_id(conn: psycopg.Connection[Any], names: Names) -> int:
    """The last event id handed out (committed or not)."""
    (newest,) = _run(conn, "newest_id", _slots(names))[0]
    return int(newest)


def convert(conn: psycopg.Connection[Any], names: Names, size: int) -> Partition:
    """Turn today's tables into partitioned ones (in the caller's transaction, under the
    migration lock), and make ``AHEAD`` partitions; the first partition (today's tables)."""
    (highest,) = _run(conn, "layout_ids", names.slots())[0]
    (records_start,) = _run(conn, "records_start", names.slots())[0]
    first = Partition(0, None, (highest // size + 1) * size)
    slots = _slots(names, first)
    first_events = index_name(names.events, "p0")
    first_records = index_name(names.deliveries, "p0")
    slots.update(
        events_pkey=sql.Identifier(names.schema, index_name(names.events, "pkey")),
        deliveries_pkey=sql.Identifier(names.schema, index_name(names.deliveries, "pkey")),
        partition_pkey=sql.Identifier(index_name(first_events, "pkey")),
        records_partition_pkey=sql.Identifier(index_name(first_records, "pkey")),
        upper_start=sql.Literal(highest + 1),
        records_start=sql.Literal(records_start),
    )
    for what in ("due", "published", "dead", "key_order", "dedupe"):
        slots[f"{what}_index_q"] = sql.Identifier(names.schema, index_name(names.events, what))
        slots[f"partition_{what}"] = sql.Identifier(index_name(first_events, what))
    _run(conn, "convert", slots)
    _make_ahead(conn, names, size, [first], highest)
    return first


def maintain(store: PostgresStore, *, before: datetime | None) -> int:
    """Make partitions ahead; with ``before``, detach and drop the partitions whose every event
    was published before it. How many events went with them.

    Raises:
        psycopg.Error: the database failed (the caller maps it).
    """
    names, size = store.names, store.partition_size
    assert size is not None
    dropped = 0
    with store.dialect.pool.connection("maintain the partitions") as conn:
        found = partitions(conn, names)
        newest = newest_id(conn, names)
        _make_ahead(conn, names, size, found, newest)
        if before is None:
            return 0
        # Interrupted detaches first: PostgreSQL detaches one partition of a table at a time,
        # so one left pending would refuse every other detach until it is finished.
        for part in sorted(found, key=lambda part: not part.detaching):
            if part.upper > newest:
                continue  # ids below its bound may still be handed out
            try:
                dropped += _retire(conn, names, part, before)
            except psycopg.errors.UndefinedTable:
                # Another maintenance detached it meanwhile (and dropped it, or is about to).
                log.info("partition %d of %s: detached elsewhere", part.number, names.events)
            except psycopg.errors.ObjectNotInPrerequisiteState:
                # A detach is pending: another maintenance is retiring partitions right now,
                # and goes on through the same list; the rest is left to it (or to the next
                # maintenance, for a range that finished since it listed them).
                log.info("partitions of %s: another maintenance is retiring them", names.events)
                break
    return dropped


def _retire(conn: psycopg.Connection[Any], names: Names, part: Partition, before: datetime) -> int:
    """Detach and drop one range if every event of it was published before ``before`` (an
    interrupted detach is finished first); how many events went."""
    if part.detaching:
        _detach(conn, names, part, finalize=True)
    else:
        done, _ = _run(conn, "finished", _slots(names, part), {"before": before})[0]
        if not done:
            return 0
        _detach(conn, names, part, finalize=False)
    return _drop_or_reattach(conn, names, part, before)


def _make_ahead(
    conn: psycopg.Connection[Any], names: Names, size: int, found: list[Partition], newest: int
) -> None:
    """Make the partitions up to ``AHEAD`` above the one ``newest`` is in; under a lock, so a
    maintenance running at the same time in another process makes none twice."""
    wanted = (newest // size + 1 + AHEAD) * size
    if max((p.upper for p in found), default=0) >= wanted:
        return
    with conn.transaction():
        key = zlib.crc32(f"{names.schema}.{names.events}".encode()) - (1 << 31)
        _run(conn, "lock_maintenance", {}, {"lock_space": _LOCK_SPACE, "lock_key": key})
        top = max((p.upper for p in partitions(conn, names)), default=0)  # made meanwhile?
        while top < wanted:
            part = Partition(top // size, top, top + size)
            _run(conn, "create", _slots(names, part))
            log.info(
                "partition %d of %s made (ids %d to %d)",
                part.number,
                names.events,
                top,
                top + size - 1,
            )
            top += size


def _detach(
    conn: psycopg.Connection[Any], names: Names, part: Partition, *, finalize: bool
) -> None:
    """Detach a range's two partitions (finishing an interrupted detach of either)."""
    slots = _slots(names, part)
    _run(conn, "detach_finalize" if finalize else "detach", slots)
    state = _run(conn, "records_state", slots)
    if state:  # still attached: detach it, or finish its interrupted detach
        _run(conn, "detach_records_finalize" if state[0][0] else "detach_records", slots)


def _drop_or_reattach(
    conn: psycopg.Connection[Any], names: Names, part: Partition, before: datetime
) -> int:
    """Drop a detached range, or put it back if it is not finished after all: an enqueue that
    had taken an id in it before the check may have committed since (the detach waited for
    it). How many events were dropped."""
    slots = _slots(names, part)
    with conn.transaction():
        done, count = _run(conn, "finished", slots, {"before": before})[0]
        if done:
            _run(conn, "drop", slots)
            log.info(
                "partition %d of %s dropped (%d published events)", part.number, names.events, count
            )
            return int(count)
        _run(conn, "reattach", slots)
        _run(conn, "reattach_records", slots)
        log.warning(
            "partition %d of %s put back: an event in it is not finished", part.number, names.events
        )
        return 0
