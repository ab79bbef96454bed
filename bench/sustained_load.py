"""PG, sustained load: the highest enqueue rate at which the backlog stays flat (it grows by at
most 100 events/s over the run) with pollers and retention running; then, at a fixed rate, three
phases — before, during and after one idle-in-transaction session holding back vacuum (xmin) —
with the claim's latency (a probe claiming one event and releasing it, five times a second) and
the published rate of each. Bounded in time: every phase and rate stops by itself.

    python bench/sustained_load.py [--pg-url URL] [--rates 200,400,800,1600] [--seconds 60]
                                   [--pollers 2] [--xmin-rate R] [--phase-seconds 60]

The reference of the phases is the ``before`` phase of the same run (ratios to it); a rate is
"flat" when the backlog's least-squares slope over the last two thirds of its run is at most
100 events/s. Retention: ``retain_published`` of 30 s, pruned by the pollers (at most once a
minute each).
"""

from __future__ import annotations

import argparse
import threading
import time
from datetime import timedelta
from typing import Any

import psycopg
from _common import median, percentile, pg_schema, pg_url_default
from psycopg import sql

from outboxkit import EventBus, Outbox
from outboxkit_pg import PostgresStore

FLAT = 100.0  # events/s of backlog growth still called flat
TICK = 0.02  # seconds between the producer's transactions


def _outbox(url: str, schema: str, pollers: int) -> Outbox:
    store = PostgresStore(url, schema=schema, pool_max_size=pollers + 4)
    store.migrate()
    bus = EventBus()
    bus.subscribe("load.tick", lambda event, ctx: None, name="noop")
    return Outbox(store, bus, retain_published=timedelta(seconds=30), load_entry_points=False)


class _Run:
    """Pollers, a producer at ``rate`` events/s, and a sampler of the backlog, until stopped."""

    def __init__(self, outbox: Outbox, rate: float, pollers: int) -> None:
        self.outbox = outbox
        self.rate = rate
        self.stop = threading.Event()
        self.pollers = [outbox.poller(batch_size=100, interval=0.05) for _ in range(pollers)]
        self.produced = 0
        self.samples: list[tuple[float, int, int]] = []  # (t, pending, published)
        self.threads = [threading.Thread(target=p.run_forever, daemon=True) for p in self.pollers]
        self.threads += [
            threading.Thread(target=self._produce, daemon=True),
            threading.Thread(target=self._sample, daemon=True),
        ]

    def _produce(self) -> None:
        store = self.outbox.store
        started = time.monotonic()
        while not self.stop.is_set():
            owed = int((time.monotonic() - started) * self.rate) - self.produced
            if owed > 0:
                with store.transaction() as conn:
                    self.outbox.enqueue_many(conn, [("load.tick", {})] * min(owed, 2000))
                self.produced += min(owed, 2000)
            self.stop.wait(TICK)

    def _sample(self) -> None:
        while not self.stop.wait(1.0):
            stats = self.outbox.stats()
            self.samples.append((time.monotonic(), stats.pending + stats.claimed, stats.published))

    def __enter__(self) -> _Run:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for poller in self.pollers:
            poller.stop()
        for thread in self.threads:
            thread.join(timeout=60)


def _slope(points: list[tuple[float, float]]) -> float:
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0


def sustained(url: str, rates: list[float], seconds: float, pollers: int) -> float:
    print(f"sustained load, {pollers} pollers, {seconds:g} s per rate, retention 30 s:")
    best = 0.0
    for rate in rates:
        with pg_schema(url, "okb_load") as schema:
            outbox = _outbox(url, schema, pollers)
            try:
                with _Run(outbox, rate, pollers) as run:
                    time.sleep(seconds)  # a benchmark's run, not a test: it waits its length
                tail = run.samples[len(run.samples) // 3 :]
                slope = _slope([(t, float(p)) for t, p, _ in tail])
                span = tail[-1][0] - tail[0][0] if len(tail) > 1 else 1.0
                published = (tail[-1][2] - tail[0][2]) / span if len(tail) > 1 else 0.0
            finally:
                outbox.store.close()
        flat = slope <= FLAT
        best = rate if flat else best
        print(
            f"  {rate:7.0f}/s offered: {published:8.1f} published/s, backlog slope "
            f"{slope:+8.1f}/s, last backlog {tail[-1][1] if tail else 0:7d}  "
            f"{'flat' if flat else 'GROWS'}"
        )
        if not flat:
            break
    print(f"  highest flat rate: {best:.0f} events/s")
    return best


def _probe(store: PostgresStore, stop: threading.Event, out: list[float]) -> None:
    while not stop.wait(0.2):
        started = time.perf_counter()
        claims = store.claim(batch_size=1, lease=timedelta(seconds=30), now=None)
        out.append(time.perf_counter() - started)
        store.release(claims, now=None)


def _dead_rows(url: str, schema: str, table: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT coalesce(n_dead_tup, 0) FROM pg_stat_user_tables"
            " WHERE schemaname = %s AND relname = %s",
            [schema, table],
        ).fetchone()
    return int(row[0]) if row else 0


def xmin_phases(url: str, rate: float, seconds: float, pollers: int) -> None:
    print(f"idle in transaction at {rate:.0f} events/s, {seconds:g} s per phase:")
    with pg_schema(url, "okb_xmin") as schema:
        outbox = _outbox(url, schema, pollers)
        store = outbox.store
        assert isinstance(store, PostgresStore)
        rows: dict[str, dict[str, Any]] = {}
        holder: psycopg.Connection[Any] | None = None
        try:
            with _Run(outbox, rate, pollers) as run:
                for phase in ("before", "during", "after"):
                    if phase == "during":
                        holder = psycopg.connect(url)
                        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                        holder.execute(
                            sql.SQL("SELECT count(*) FROM {}").format(
                                sql.Identifier(schema, store.names.events)
                            )
                        )  # a snapshot held: xmin pinned, idle in transaction
                    elif phase == "after" and holder is not None:
                        holder.rollback()
                        holder.close()
                        holder = None
                    stop, latencies = threading.Event(), []  # type: ignore[var-annotated]
                    probe = threading.Thread(target=_probe, args=(store, stop, latencies))
                    first = len(run.samples)
                    probe.start()
                    time.sleep(seconds)  # the phase's length (a benchmark, not a test)
                    stop.set()
                    probe.join()
                    window = run.samples[first:]
                    span = window[-1][0] - window[0][0] if len(window) > 1 else 1.0
                    rows[phase] = {
                        "p50": median(latencies) * 1e3,
                        "p99": percentile(latencies, 99) * 1e3,
                        "published": (window[-1][2] - window[0][2]) / span if window else 0.0,
                        "backlog": window[-1][1] if window else 0,
                        "dead": _dead_rows(url, schema, store.names.events),
                    }
        finally:
            if holder is not None:
                holder.close()
            store.close()
    base = rows["before"]
    for phase, row in rows.items():
        print(
            f"  {phase:7s} claim p50 {row['p50']:7.2f} ms ({row['p50'] / base['p50']:5.2f}x), "
            f"p99 {row['p99']:7.2f} ms, {row['published']:8.1f} published/s "
            f"({row['published'] / max(base['published'], 1e-9):5.2f}x), backlog "
            f"{row['backlog']:6d}, dead rows {row['dead']:8d}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg-url", default=pg_url_default())
    parser.add_argument("--rates", default="200,400,800,1600")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--pollers", type=int, default=2)
    parser.add_argument("--xmin-rate", type=float, default=None)
    parser.add_argument("--phase-seconds", type=float, default=60.0)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    best = sustained(args.pg_url, rates, args.seconds, args.pollers)
    rate = args.xmin_rate if args.xmin_rate is not None else max(best / 2, rates[0] / 2)
    xmin_phases(args.pg_url, rate, args.phase_seconds, args.pollers)


if __name__ == "__main__":
    main()
