"""``outboxkit doctor`` on PostgreSQL: what the server knows about the outbox's tables and
what holds them back, each finding with its fix (``outboxkit.diagnosis.Finding``).

- ``migrations``: the schema's version, and the migrations missing (by number and name);
- ``transactions``: transactions open longer than the limit that hold an xid or a snapshot
  (they hold back vacuum for every table: an idle-in-transaction session is the usual one),
  prepared transactions, and replication slots holding an old xmin;
- ``settings``: ``idle_in_transaction_session_timeout`` unset, autovacuum or its statistics off;
- ``tables``: per outbox table, live and dead rows, the size on disk against an estimate of what
  the live rows need (bloat), the indexes' size, and the autovacuum settings the migration
  gives the events table;
- ``stale_leases``: events whose lease ran out longer ago than the limit and that no poller
  claimed again (no poller runs, or all are stuck).

Read-only, in autocommit (the doctor holds no snapshot of its own), on the store's own
connection; identifiers through ``psycopg.sql.Identifier``, values bound.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from outboxkit.diagnosis import Finding, Limits

from . import partitions
from .names import index_name
from .store import MIGRATIONS, SCHEMA_VERSION

if TYPE_CHECKING:
    from .store import PostgresStore

__all__ = ["server_findings"]

DEAD_ROWS_PROBLEM = 10_000  # dead rows (with more than DEAD_SHARE of the table) that hurt claims
DEAD_SHARE = 0.2
BLOAT_SHARE = 0.5  # the share of a table's size that its live rows do not need
BLOAT_MIN_BYTES = 8 << 20  # tables smaller than this are not worth a finding
ROW_OVERHEAD = 28  # a heap tuple's header and its line pointer, bytes
EVENTS_FILLFACTOR = 0.8


def server_findings(store: PostgresStore, limits: Limits) -> list[Finding]:
    """The server's findings (see the module docstring).

    Raises:
        StoreError: the server cannot be reached.
    """
    findings: list[Finding] = []
    with store.dialect.connection("diagnose", check_schema=False) as conn:
        no_tables = False
        checks = (_migrations, _transactions, _settings, _tables, _stale_leases, _partitions)
        for check in checks:
            if no_tables and check in (_tables, _stale_leases, _partitions):
                continue  # no schema yet: nothing of its tables to check
            try:
                found = check(store, conn, limits)
            except psycopg.Error as exc:
                reason = " ".join(str(exc).split())
                found = [Finding(check.__name__.strip("_"), "warning", f"not checked: {reason}")]
            findings += found
            no_tables = no_tables or (check is _migrations and found[0].details.get("version") == 0)
    return findings


def _one(conn: Any, query: sql.Composable, params: dict[str, Any] | None = None) -> Any:
    row = conn.execute(query, params or {}).fetchone()
    return None if row is None else row


def _migrations(store: PostgresStore, conn: Any, limits: Limits) -> list[Finding]:
    names = store.names
    exists = _one(
        conn,
        sql.SQL("SELECT to_regclass(%(table)s) IS NOT NULL"),
        {"table": sql.Identifier(names.schema, names.versions).as_string(conn)},
    )
    found = 0
    if exists and exists[0]:
        row = _one(
            conn,
            sql.SQL("SELECT coalesce(max(version), 0) FROM {}").format(
                sql.Identifier(names.schema, names.versions)
            ),
        )
        found = int(row[0]) if row else 0
    missing = [(v, d) for v, d in MIGRATIONS if v > found]
    details = {"version": found, "expected": SCHEMA_VERSION, "missing": [v for v, _ in missing]}
    if not missing:
        return [Finding("migrations", "ok", f"schema at version {found}", details=details)]
    listed = "; ".join(f"{v}: {d}" for v, d in missing)
    return [
        Finding(
            "migrations",
            "problem",
            f"schema {names.schema!r} at version {found}, {SCHEMA_VERSION} needed: "
            f"missing migration(s) {listed}",
            fix="outboxkit migrate --store URL (the server's own address, not a pooler's), "
            "before the pollers of this outboxkit version start",
            details=details,
        )
    ]


_OLD_TRANSACTIONS = sql.SQL(
    """SELECT pid, usename, application_name, state,
          extract(epoch FROM now() - xact_start)::float8,
          greatest(age(backend_xid), age(backend_xmin)), left(query, 200)
     FROM pg_stat_activity
    WHERE (backend_xid IS NOT NULL OR backend_xmin IS NOT NULL)
      AND pid <> pg_backend_pid()
      AND xact_start < now() - make_interval(secs => %(seconds)s)
    ORDER BY xact_start
    LIMIT 5"""
)
_OLD_PREPARED = sql.SQL(
    """SELECT gid, owner, extract(epoch FROM now() - prepared)::float8, age(transaction)
     FROM pg_prepared_xacts
    WHERE prepared < now() - make_interval(secs => %(seconds)s)
    ORDER BY prepared LIMIT 5"""
)
_SLOTS = sql.SQL(
    """SELECT slot_name, active, greatest(age(xmin), age(catalog_xmin))
     FROM pg_replication_slots
    WHERE NOT active AND (xmin IS NOT NULL OR catalog_xmin IS NOT NULL)"""
)


def _transactions(store: PostgresStore, conn: Any, limits: Limits) -> list[Finding]:
    seconds = limits.transaction.total_seconds()
    params = {"seconds": seconds}
    sessions = conn.execute(_OLD_TRANSACTIONS, params).fetchall()
    prepared = conn.execute(_OLD_PREPARED, params).fetchall()
    slots = conn.execute(_SLOTS).fetchall()
    if not sessions and not prepared and not slots:
        return [
            Finding(
                "transactions",
                "ok",
                f"no transaction holding back vacuum has been open longer than {seconds:g}s",
            )
        ]
    findings = []
    for pid, user, app, state, age, xid_age, query in sessions:
        findings.append(
            Finding(
                "transactions",
                "problem",
                f"session pid {pid} ({user}, application {app or '-'!r}) {state} for "
                f"{age:.0f}s holds back vacuum (xmin {xid_age} transactions old): every "
                f"dead row since stays, and claims slow down; last query: {query!r}",
                fix=f"end it (SELECT pg_terminate_backend({pid})), then fix the code that "
                "leaves it open; set idle_in_transaction_session_timeout so that the server "
                "ends such sessions itself",
                details={
                    "pid": pid,
                    "user": user,
                    "application_name": app,
                    "state": state,
                    "seconds": age,
                    "xid_age": xid_age,
                },
            )
        )
    for gid, owner, age, xid_age in prepared:
        findings.append(
            Finding(
                "transactions",
                "problem",
                f"prepared transaction {gid!r} ({owner}) open for {age:.0f}s holds back vacuum "
                f"(xmin {xid_age} transactions old)",
                fix=f"COMMIT PREPARED {gid!r} or ROLLBACK PREPARED {gid!r}",
                details={"gid": gid, "seconds": age},
            )
        )
    for name, _active, xid_age in slots:
        findings.append(
            Finding(
                "transactions",
                "problem",
                f"inactive replication slot {name!r} holds back vacuum (xmin {xid_age} "
                "transactions old)",
                fix=f"reconnect its consumer, or SELECT pg_drop_replication_slot({name!r})",
                details={"slot": name},
            )
        )
    return findings


def _settings(store: PostgresStore, conn: Any, limits: Limits) -> list[Finding]:
    rows = conn.execute(
        sql.SQL(
            "SELECT name, setting FROM pg_settings WHERE name IN "
            "('idle_in_transaction_session_timeout', 'autovacuum', 'track_counts')"
        )
    ).fetchall()
    settings = dict(rows)
    findings = []
    database = conn.info.dbname
    if settings.get("idle_in_transaction_session_timeout", "0") == "0":
        findings.append(
            Finding(
                "settings",
                "warning",
                "idle_in_transaction_session_timeout is 0: a session left idle in a "
                "transaction holds back vacuum until someone ends it",
                fix=f"ALTER DATABASE {sql.Identifier(database).as_string(conn)} SET "
                "idle_in_transaction_session_timeout = '5min' (or per role)",
                details={"idle_in_transaction_session_timeout": "0"},
            )
        )
    for name in ("autovacuum", "track_counts"):
        if settings.get(name) == "off":
            findings.append(
                Finding(
                    "settings",
                    "problem",
                    f"{name} is off: dead rows of the outbox tables are never cleaned up",
                    fix=f"{name} = on in postgresql.conf (then SELECT pg_reload_conf())",
                    details={name: "off"},
                )
            )
    if not findings:
        findings.append(Finding("settings", "ok", "no setting that hurts a queue table found"))
    return findings


_TABLES = sql.SQL(
    """SELECT c.relname, pg_relation_size(c.oid), pg_indexes_size(c.oid),
          coalesce(s.n_live_tup, 0), coalesce(s.n_dead_tup, 0),
          greatest(s.last_autovacuum, s.last_vacuum), c.reloptions
     FROM pg_class c
     JOIN pg_namespace n ON n.oid = c.relnamespace
     LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
    WHERE n.nspname = %(schema)s AND c.relname = ANY(%(tables)s) AND c.relkind = 'r'
    ORDER BY c.relname"""
)


def _tables(store: PostgresStore, conn: Any, limits: Limits) -> list[Finding]:
    names = store.names
    tables, events_tables = [names.events, names.deliveries], {names.events}
    if store.partition_size is not None:  # the partitions hold the rows
        for part in partitions.partitions(conn, names):
            events_tables.add(index_name(names.events, f"p{part.number}"))
            tables.append(index_name(names.deliveries, f"p{part.number}"))
        tables += sorted(events_tables)
    rows = conn.execute(_TABLES, {"schema": names.schema, "tables": tables}).fetchall()
    findings = []
    for table, size, index_size, live, dead, vacuumed, reloptions in rows:
        ident = sql.Identifier(names.schema, table)
        shown = ident.as_string(conn)
        row_bytes = _one(
            conn,
            sql.SQL(
                "SELECT avg(pg_column_size(t.*))::float8 FROM (SELECT * FROM {} LIMIT 1000) t"
            ).format(ident),
        )
        width = float(row_bytes[0]) if row_bytes and row_bytes[0] is not None else 0.0
        fill = EVENTS_FILLFACTOR if table in events_tables else 1.0
        needed = live * (width + ROW_OVERHEAD) / fill
        bloat = max(size - needed, 0.0)
        details = {
            "table": shown,
            "bytes": size,
            "index_bytes": index_size,
            "live_rows": live,
            "dead_rows": dead,
            "bloat_bytes_estimate": round(bloat),
            "last_vacuum": None if vacuumed is None else vacuumed.isoformat(),
        }
        share = dead / (live + dead) if live + dead else 0.0
        vacuum_fix = (
            f"VACUUM (ANALYZE) {shown}; if it does not shrink, end the transaction holding it "
            "back (see transactions) and let autovacuum catch up"
        )
        if dead >= DEAD_ROWS_PROBLEM and share > DEAD_SHARE:
            findings.append(
                Finding(
                    "dead_tuples",
                    "problem",
                    f"{shown}: {dead} dead rows ({share:.0%} of its rows): every claim reads "
                    "past them",
                    fix=vacuum_fix,
                    details=details,
                )
            )
        else:
            findings.append(
                Finding("dead_tuples", "ok", f"{shown}: {dead} dead, {live} live rows", "", details)
            )
        if size >= BLOAT_MIN_BYTES and bloat > BLOAT_SHARE * size:
            findings.append(
                Finding(
                    "bloat",
                    "warning",
                    f"{shown}: {size >> 20} MiB on disk, its {live} live rows need about "
                    f"{int(needed) >> 20} MiB (estimate); indexes {index_size >> 20} MiB",
                    fix=f"pg_repack -t {shown} (online), or VACUUM FULL {shown} in a quiet "
                    f"moment (it locks the table); REINDEX TABLE CONCURRENTLY {shown} for the "
                    "indexes; then retention (retain_published) keeps it small",
                    details=details,
                )
            )
        if table in events_tables and not any(
            option.startswith("autovacuum_vacuum_scale_factor") for option in reloptions or ()
        ):
            findings.append(
                Finding(
                    "autovacuum",
                    "warning",
                    f"{shown} has not the autovacuum settings the migration gives it",
                    fix=f"ALTER TABLE {shown} SET (autovacuum_vacuum_scale_factor = 0.02, "
                    "autovacuum_analyze_scale_factor = 0.02)",
                    details={"table": shown, "reloptions": list(reloptions or ())},
                )
            )
    return findings


def _stale_leases(store: PostgresStore, conn: Any, limits: Limits) -> list[Finding]:
    seconds = limits.stale_lease.total_seconds()
    query = sql.SQL(
        """SELECT count(*), extract(epoch FROM now() - min(locked_until))::float8
         FROM {}
        WHERE published_at IS NULL AND failed_at IS NULL
          AND locked_until < now() - make_interval(secs => %(seconds)s)"""
    ).format(sql.Identifier(store.names.schema, store.names.events))
    row = _one(conn, query, {"seconds": seconds})
    count, oldest = (int(row[0]), row[1]) if row else (0, None)
    if not count:
        return [Finding("stale_leases", "ok", f"no lease ran out more than {seconds:g}s ago")]
    return [
        Finding(
            "stale_leases",
            "problem",
            f"{count} event(s) whose lease ran out up to {oldest:.0f}s ago were not claimed "
            "again: no poller is running, or every one is stuck",
            fix="start pollers (outboxkit run APP) or restart the stuck ones; the events are "
            "due and are claimed at once",
            details={"events": count, "oldest_seconds": oldest},
        )
    ]


def _partitions(store: PostgresStore, conn: Any, limits: Limits) -> list[Finding]:
    """The partitioned layout: partitions ready above the newest id, and detaches left half
    done."""
    if store.partition_size is None:
        return []
    found = partitions.partitions(conn, store.names)
    newest = partitions.newest_id(conn, store.names)
    ahead = sum(1 for p in found if p.lower is not None and p.lower > newest)
    top = max((p.upper for p in found), default=0)
    details = {"partitions": len(found), "ahead": ahead, "newest_id": newest, "top": top}
    maintain = (
        "run the store's maintenance: set the outbox's retain_published (the pollers run it "
        "every minute), or run `outboxkit purge` on a schedule, or call "
        "store.maintain_partitions()"
    )
    findings = []
    if ahead == 0:
        findings.append(
            Finding(
                "partitions",
                "problem",
                f"no partition is ready above event id {newest}: enqueues fail once the ids "
                f"pass {top - 1}",
                fix=maintain,
                details=details,
            )
        )
    elif ahead < partitions.AHEAD:
        findings.append(
            Finding(
                "partitions",
                "warning",
                f"{ahead} partition(s) ready above event id {newest} (the maintenance keeps "
                f"{partitions.AHEAD}): it has not run lately",
                fix=maintain,
                details=details,
            )
        )
    half = [p.number for p in found if p.detaching]
    if half:
        findings.append(
            Finding(
                "partitions",
                "warning",
                f"the detach of partition(s) {half} was interrupted",
                fix="the next retention run finishes it (store.maintain_partitions(before=...))",
                details={**details, "detaching": half},
            )
        )
    return findings or [
        Finding(
            "partitions", "ok", f"{len(found)} partitions, {ahead} ready ahead", details=details
        )
    ]
