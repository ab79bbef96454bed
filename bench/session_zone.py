"""PG: the cost of one claim of 100 (claim, then release) on the store's sessions put in UTC by
``SET TimeZone`` (what the store does, a transaction pooler allowing it), against sessions put in
UTC by libpq's startup ``options`` (what it did before: PgBouncer refuses that parameter), and
against sessions left in the server's default zone (psycopg then converts every instant to a
named zone). Alternating rounds, one command; the ratio is to the ``options`` sessions.

    python bench/session_zone.py [--pg-url URL] [--rounds 30] [--claims 50]
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta

from _common import median, pg_schema, pg_url_default
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from outboxkit import Outbox
from outboxkit_pg import PostgresStore

EVENTS = 1_000
BATCH = 100
LEASE = timedelta(seconds=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg-url", default=pg_url_default())
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--claims", type=int, default=50, help="claims per round and store")
    args = parser.parse_args()
    params = {k: v for k, v in conninfo_to_dict(args.pg_url).items() if k != "options"}
    with pg_schema(args.pg_url) as schema:
        stores = {
            "SET TimeZone (the store now)": PostgresStore(make_conninfo(**params), schema=schema),
            "startup options (before)": PostgresStore(
                make_conninfo(**params, options="-c TimeZone=UTC"), schema=schema
            ),
            "server's zone (no UTC)": PostgresStore(
                make_conninfo(**params, options="-c TimeZone=Etc/UTC"), schema=schema
            ),
        }
        first = next(iter(stores.values()))
        first.migrate()
        outbox = Outbox(first, load_entry_points=False)
        with first.transaction() as conn:
            outbox.enqueue_many(conn, [("bench.zone", {"n": n}) for n in range(EVENTS)])
        times: dict[str, list[float]] = {name: [] for name in stores}
        try:
            for store in stores.values():  # warm: pools open, statements prepared
                for _ in range(10):
                    store.release(store.claim(batch_size=BATCH, lease=LEASE, now=None), now=None)
            order = list(stores.items())
            for round_number in range(args.rounds):
                shift = round_number % len(order)  # each store first in turn
                for name, store in order[shift:] + order[:shift]:
                    started = time.perf_counter()
                    for _ in range(args.claims):
                        claims = store.claim(batch_size=BATCH, lease=LEASE, now=None)
                        store.release(claims, now=None)
                    times[name].append((time.perf_counter() - started) / args.claims)
        finally:
            for store in stores.values():
                store.close()
    reference = median(times["startup options (before)"])
    print(f"claim {BATCH} + release, median of {args.rounds} rounds of {args.claims}:")
    for name, samples in times.items():
        value = median(samples)
        print(f"  {name:30s} {value * 1e3:7.3f} ms   ratio {value / reference:5.3f}")


if __name__ == "__main__":
    main()
