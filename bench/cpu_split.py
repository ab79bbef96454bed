"""PostgreSQL per batch: the CPU each drain costs the client and the server, per event.

Drains ``--events`` events in batches of 100, one process, on a fresh schema each time: the
minimal per-batch loop of ``compare.py``, outboxkit's own statements sent by a plain loop (its
``--bare`` line) and outboxkit's poller (``transaction="per_batch"``, without and with
``prefetch``), the four alternating for ``--rounds`` rounds. For each drain: this process's CPU
time (``time.process_time``: every thread of it), the server's (the CPU time every ``postgres``
process of this machine spent meanwhile, read from ``/proc``: the backends, the WAL writer,
the checkpointer), and the wall time, in µs per event, medians.

Two pollers on two cores share the machine's CPU with the server: the sum of the two is what a
drain costs there. Not a throughput figure (``compare.py`` is); where the time goes. Needs the
server on this machine (it refuses to run otherwise).

    python bench/cpu_split.py
    python bench/cpu_split.py --events 20000 --rounds 7
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import compare
import psycopg
from _common import pg_schema, pg_url_default

from outboxkit import EventBus, Outbox
from outboxkit.poller import ThreadWaiter
from outboxkit_pg import PostgresStore

BATCH = compare.BATCH
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def server_cpu() -> float:
    """Seconds of CPU (user + system) every ``postgres`` process of this machine has used."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # ended meanwhile
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        if name.startswith("postgres"):
            fields = text[text.rindex(")") + 2 :].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLOCK_TICKS


Split = tuple[float, float, float]  # client CPU, server CPU, wall (seconds)


@contextlib.contextmanager
def measured(out: list[Split]) -> Any:
    server, client, wall = server_cpu(), time.process_time(), time.perf_counter()
    yield
    out.append((time.process_time() - client, server_cpu() - server, time.perf_counter() - wall))


def minimal(url: str, schema: str, events: int) -> Split:
    """The minimal per-batch loop (``compare.py``'s ``ref-batch-1``)."""
    out: list[Split] = []
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(compare._pg(compare.PG_REF_DDL, schema))
        conn.execute(
            compare._pg(compare.PG_REF_FILL, schema), {"topic": compare.TOPIC, "n": events}
        )
        conn.execute(compare._pg("VACUUM ANALYZE {s}.ref_events", schema))
        claim = compare._pg(compare.ref_claim(), schema)
        record = compare._pg(compare.PG_REF_RECORD, schema)
        mark = compare._pg(compare.PG_REF_MARK, schema)
        with measured(out):
            while True:
                with conn.transaction():
                    rows = conn.execute(claim, {"batch": BATCH}).fetchall()
                    for event_id, topic, payload in rows:
                        compare.noop(event_id, topic, payload)
                    with conn.cursor() as cur:
                        cur.executemany(record, [(row[0], compare.HANDLER) for row in rows])
                    conn.execute(mark, ([row[0] for row in rows],))
                if not rows:
                    break
        published = conn.execute(
            compare._pg(
                "SELECT count(*) FROM {s}.ref_events WHERE published_at IS NOT NULL", schema
            )
        ).fetchone()
    assert published == (events,), published
    return out[0]


def _store(url: str, schema: str, events: int) -> tuple[PostgresStore, Outbox, list[int]]:
    calls = [0]

    def handle(event: Any, ctx: Any) -> None:
        calls[0] += 1

    bus = EventBus()
    bus.subscribe(compare.TOPIC, handle, name=compare.HANDLER)
    store = PostgresStore(url, schema=schema, notify=False)
    store.migrate()
    outbox = Outbox(store, bus, load_entry_points=False)
    compare._fill_kit(outbox, events)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(compare._pg("VACUUM ANALYZE {s}.outbox_events", schema))
    return store, outbox, calls


def bare(url: str, schema: str, events: int) -> Split:
    """outboxkit's statements by a plain loop (``compare.py``'s ``bare-batch-1``)."""
    store, _, _ = _store(url, schema, events)
    queries = store._queries
    _, claim = store._claim_query(BATCH, datetime.timedelta(seconds=30), None, "release")
    out: list[Split] = []
    settled = 0
    with contextlib.closing(store), psycopg.connect(url, autocommit=True) as conn, measured(out):
        while rows := conn.execute(queries["claim"], claim).fetchall():
            conn.execute(b"BEGIN")
            for row in rows:
                compare.noop(row[0], row[2])
            ids = [row[0] for row in rows]
            params = {
                "now": None,
                "ids": ids,
                "tokens": [row[12] for row in rows],
                "record_ids": ids,
                "handlers": [compare.HANDLER] * len(rows),
            }
            settled += len(conn.execute(queries["publish_recording"], params).fetchall())
            conn.execute(b"COMMIT")
    assert settled == events, settled
    return out[0]


def poller(prefetch: bool) -> Callable[[str, str, int], Split]:
    def drain(url: str, schema: str, events: int) -> Split:
        """outboxkit's poller, ``per_batch`` (``compare.py``'s ``kit-batch-1[p]``)."""
        store, outbox, calls = _store(url, schema, events)
        run = outbox.poller(
            batch_size=BATCH, waiter=ThreadWaiter(), transaction="per_batch", prefetch=prefetch
        )
        out: list[Split] = []
        with contextlib.closing(store):
            with contextlib.ExitStack() as held:  # the connections it holds at once, opened
                for _ in range(2):
                    held.enter_context(store.transaction())
            with measured(out):
                run.run_until_idle()
            assert calls[0] == events and store.stats(now=None).published == events
        return out[0]

    return drain


DRAINS: dict[str, Callable[[str, str, int], Split]] = {
    "minimal loop": minimal,
    "outboxkit's statements": bare,
    "poller": poller(prefetch=False),
    "poller, prefetch": poller(prefetch=True),
}


def run(url: str, events: int, rounds: int) -> dict[str, list[Split]]:
    """Every drain ``rounds`` times, alternating, the order rotating each round."""
    names = list(DRAINS)
    splits: dict[str, list[Split]] = {name: [] for name in names}
    for round_ in range(rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            with pg_schema(url) as schema:
                splits[name].append(DRAINS[name](url, schema, events))
    return splits


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pg-url", default=pg_url_default())
    args = parser.parse_args()
    if args.events < 1 or args.rounds < 1:
        parser.error("--events and --rounds must be at least 1")
    if server_cpu() == 0:
        parser.error("no postgres process on this machine: the server's CPU cannot be read")
    print(
        f"per batch of {BATCH}, {args.events:,} events, {args.rounds} rounds; µs per event, medians"
    )
    for name, got in run(args.pg_url, args.events, args.rounds).items():
        client, server, wall = (
            statistics.median(split[i] for split in got) / args.events * 1e6 for i in range(3)
        )
        print(
            f"  {name:<24} client CPU {client:6.1f}  server CPU {server:6.1f}"
            f"  both {client + server:6.1f}  wall {wall:6.1f}"
        )


if __name__ == "__main__":
    main()
