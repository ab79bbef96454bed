"""Test-kit overhead: what one app test pays for the outboxkit fixtures.

Per test: a fresh store (migrated), 5 enqueues in one transaction, and an ``outbox_drain()``
that delivers them to one transactional handler. Prints the median, p90 and max over N tests.

    python bench/testkit_overhead.py                 # SQLite file per test (the default)
    python bench/testkit_overhead.py --store memory://
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from outboxkit import EventBus, FrozenClock, Outbox
from outboxkit.testing import Drain, open_test_store


def one_test(url: str | None, tmp: Path, bus: EventBus) -> float:
    started = time.perf_counter()
    clock = FrozenClock()
    with open_test_store(url, tmp, "bench") as store:
        outbox = Outbox(store, bus, clock=clock, load_entry_points=False)
        drain = Drain(outbox, clock)
        with store.transaction() as conn:
            for n in range(5):
                outbox.enqueue(conn, "bench.event", {"n": n})
        report = drain()
        assert len(report.published) == 5
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=200)
    parser.add_argument("--store", default=None, help="store URL (default: SQLite file per test)")
    args = parser.parse_args()
    bus = EventBus()
    bus.subscribe("bench.event", lambda event, ctx: None, name="noop")
    samples = []
    with tempfile.TemporaryDirectory(prefix="outboxkit-bench-") as root:
        for i in range(args.tests):
            tmp = Path(root) / f"t{i}"
            tmp.mkdir()
            samples.append(one_test(args.store, tmp, bus))
    samples.sort()
    ms = [s * 1000 for s in samples]
    print(
        f"testkit overhead ({args.store or 'sqlite file'}), {args.tests} tests: "
        f"median {statistics.median(ms):.2f} ms, p90 {ms[int(len(ms) * 0.9)]:.2f} ms, "
        f"max {ms[-1]:.2f} ms per test (fresh store + enqueue 5 + drain)"
    )


if __name__ == "__main__":
    main()
