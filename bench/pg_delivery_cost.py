"""PostgreSQL: what the server spends on one transactional delivery whose handler writes a row.

The statements of one delivery, sent by a plain loop (no poller, no Python of outboxkit's):
outboxkit's three pipeline syncs (``BEGIN`` with the token check and row lock; the handler's
``INSERT``; ``RESET ROLE``, the savepoint before the records, ``close_delivery`` - R17's
check, the record and R18's reset in one function call - and ``COMMIT``), then the same with
a rule's own statements taken out, against the hand-written loop of ``compare.py``
(``BEGIN``; the handler's ``INSERT``; the record; ``COMMIT``). For each, the server's CPU per
delivery (the backend's own, from ``/proc``, read on the same connection: the commit's flush
by the WAL writer is not in it), the WAL it writes, and the wall time of the loop. The
statements are the store's own (``queries.sql``) and ``outboxkit_pg.flow``'s.

What is taken out, and what that costs the guarantees (so these variants are measurements, not
options):

- ``no-savepoint``: the savepoint before the records (a close statement psycopg deallocated
  under the handler would then roll the handler's writes back).
- ``unprepared``: no savepoint, and the close statement not prepared (parsed and planned at
  each delivery: nothing psycopg deallocates can fail it).
- ``select-lock``: the token check as ``SELECT ... FOR UPDATE`` instead of the commit guard's
  no-op ``UPDATE`` (R17: a handler's ``COMMIT`` would then commit its writes without a record).
- ``bare``: both the savepoint and the guard's update out.

Not a throughput figure (``compare.py`` is); where the server's time goes. Needs the server on
this machine (it reads the backend's CPU from ``/proc``).

    python bench/pg_delivery_cost.py
    python bench/pg_delivery_cost.py --events 5000 --rounds 5
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
from _common import pg_schema, pg_url_default
from compare import PG_APP_DDL, PG_APP_ROW, PG_RECORDS_SAVEPOINT, PG_REF_DDL, PG_REF_RECORD, _pg
from psycopg import sql

from outboxkit_pg import PostgresStore
from outboxkit_pg.flow import RESET_ROLE
from outboxkit_pg.pool import SET_UTC

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
HANDLER = "app_rows"

Flight = list[tuple[Any, str]]  # (statement, what its parameters are: "" none, "ref", "kit")


def token_of(event_id: int) -> str:
    """The claim token the setup gave event ``event_id`` (no claim statement in the loop)."""
    return str(uuid.UUID(hashlib.md5(str(event_id).encode()).hexdigest()))


def variants(store: PostgresStore, schema: str) -> dict[str, list[Flight]]:
    """Each variant's pipeline syncs, in order, for one delivery."""
    queries = store.dialect.queries
    app_row = _pg(PG_APP_ROW, schema)
    lock = queries["lock_for_delivery"]
    select_lock = queries["lock_in_batch"]  # the same check and lock, without the new version
    close = queries["close_delivery"]
    savepoint: Flight = [(PG_RECORDS_SAVEPOINT, "")]

    def kit(lock_by: Any, *, records_savepoint: bool = True, prepared: bool = True) -> list[Flight]:
        closing: Flight = [
            (RESET_ROLE, ""),
            *(savepoint if records_savepoint else []),
            (close, "kit" if prepared else "kit-unprepared"),
            (b"COMMIT", ""),
        ]
        return [[(b"BEGIN", ""), (lock_by, "kit")], [(app_row, "ref")], closing]

    return {
        "hand loop": [
            [(b"BEGIN", "")],
            [(app_row, "ref")],
            [(_pg(PG_REF_RECORD, schema), "ref-record")],
            [(b"COMMIT", "")],
        ],
        "outboxkit": kit(lock),
        "no-savepoint": kit(lock, records_savepoint=False),
        "unprepared": kit(lock, records_savepoint=False, prepared=False),
        "select-lock": kit(select_lock),
        "bare": kit(select_lock, records_savepoint=False),
    }


def params(kind: str, event_id: int) -> Any:
    if kind == "ref":
        return (event_id,)
    if kind == "ref-record":
        return (event_id, HANDLER)
    return {
        "last": True,
        "utc": True,
        "id": event_id,
        "token": token_of(event_id),
        "mark": True,
        "event_id": event_id,
        "handler": HANDLER,
        "outcome": "succeeded",
        "attempt": 1,
        "now": None,
        "reason": None,
    }


def backend_cpu(pid: int) -> float:
    """Seconds of CPU (user + system) backend ``pid`` has used."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def run(url: str, schema: str, flights: Sequence[Flight], ids: range) -> tuple[float, float, float]:
    """Deliver ``ids`` with ``flights``: server CPU (s), WAL (bytes) and wall (s) per event."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(SET_UTC)
        pid = conn.info.backend_pid
        (lsn,) = conn.execute("SELECT pg_current_wal_lsn()").fetchone() or (None,)
        cpu, started = backend_cpu(pid), time.perf_counter()
        for event_id in ids:
            for flight in flights:
                with conn.pipeline():
                    for statement, kind in flight:
                        conn.execute(
                            statement,
                            params(kind, event_id) if kind else None,
                            prepare=False if kind == "kit-unprepared" else None,
                        )
        wall, cpu = time.perf_counter() - started, backend_cpu(pid) - cpu
        (wal,) = conn.execute("SELECT pg_current_wal_lsn() - %s::pg_lsn", (lsn,)).fetchone() or (0,)
    return cpu / len(ids), float(wal) / len(ids), wall / len(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--events", type=int, default=4000, help="deliveries per variant a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pg-url", default=pg_url_default())
    args = parser.parse_args()
    if args.events < 1 or args.rounds < 1:
        parser.error("--events and --rounds must be at least 1")
    with pg_schema(args.pg_url, "outboxkit_delivery_cost") as schema:
        store = PostgresStore(args.pg_url, schema=schema, notify=False)
        try:
            store.migrate()
            plans = variants(store, schema)
            total = args.events * args.rounds * len(plans)
            with psycopg.connect(args.pg_url, autocommit=True) as conn:
                conn.execute(_pg(PG_REF_DDL, schema))
                conn.execute(_pg(PG_APP_DDL, schema))
                # Claimed events (attempt 1, a lease, the token token_of gives).
                conn.execute(
                    sql.SQL(
                        "INSERT INTO {}.outbox_events (topic, payload, headers, created_at,"
                        " available_at, attempts, locked_until, claim_token)"
                        " SELECT 'bench', jsonb_build_object('n', g), '{{}}', now(), now(), 1,"
                        " now() + interval '1 hour', md5(g::text)::uuid"
                        " FROM generate_series(1, %s) AS g"
                    ).format(sql.Identifier(schema)),
                    (total,),
                )
                conn.execute(
                    sql.SQL("VACUUM ANALYZE {}.outbox_events").format(sql.Identifier(schema))
                )
            got: dict[str, list[tuple[float, float, float]]] = {name: [] for name in plans}
            names, next_id = list(plans), 1
            for round_ in range(args.rounds):
                for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                    ids = range(next_id, next_id + args.events)
                    next_id += args.events
                    got[name].append(run(args.pg_url, schema, plans[name], ids))
        finally:
            store.close()
    print(
        f"one delivery, handler writes a row; {args.events:,} deliveries per variant, "
        f"{args.rounds} rounds, medians"
    )
    loop_cpu = statistics.median(g[0] for g in got["hand loop"])
    for name, splits in got.items():
        cpu, wal, wall = (statistics.median(s[i] for s in splits) for i in range(3))
        print(
            f"  {name:<13} server CPU {cpu * 1e6:6.1f} us ({cpu / loop_cpu:4.2f}x the loop)"
            f"  WAL {wal:5.0f} B  wall {wall * 1e6:7.1f} us"
        )


if __name__ == "__main__":
    main()
