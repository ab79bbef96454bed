"""Test-kit overhead: what one trivial app test pays for the outboxkit fixtures, per store.

The kit's test enqueues one event through the test store, drains it (``outbox_drain()``) and
asserts it was delivered; the reference test calls the same handler directly on a hand-made
event and asserts the same thing - what an app would write without the kit. Both run as
pytest tests, each round a pytest session of its own (a subprocess, as a user runs it),
``--tests`` of each per round, the two alternating for ``--rounds`` rounds (the machine's load
falls on both); the time of a test is pytest's setup + call + teardown of it, recorded by a
conftest hook. Printed per store: the median ms per test of each, the kit's overhead
(the difference) and the ratio.

    python bench/testkit_overhead.py                      # memory://, SQLite file, PostgreSQL
    python bench/testkit_overhead.py --stores memory sqlite
    OUTBOXKIT_TEST_PG=postgresql://... python bench/testkit_overhead.py --stores pg
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

APP = """
from outboxkit import EventBus

bus = EventBus()
seen = []


@bus.handler("order.placed", name="record")
def record(event, ctx):
    seen.append(event.payload["order_id"])
"""

KIT_TEST = """
import pytest
from outboxkit import Outbox
import benchapp


@pytest.fixture
def outbox(outbox_store, outbox_clock):
    return Outbox(outbox_store, benchapp.bus, clock=outbox_clock, load_entry_points=False)


@pytest.mark.parametrize("n", range({tests}))
def test_kit(outbox, outbox_drain, n):
    benchapp.seen.clear()
    with outbox.store.transaction() as conn:
        outbox.enqueue(conn, "order.placed", {{"order_id": n}})
    outbox_drain().assert_delivered("order.placed", handler="record")
    assert benchapp.seen == [n]
"""

DIRECT_TEST = """
import pytest
from outboxkit import Event
import benchapp


@pytest.mark.parametrize("n", range({tests}))
def test_direct(n):
    benchapp.seen.clear()
    benchapp.record(Event(id=1, topic="order.placed", payload={{"order_id": n}}), None)
    assert benchapp.seen == [n]
"""

STORES = {
    "memory": "memory://",
    "sqlite": "",  # the kit's default: a SQLite file per test
    "pg": os.environ.get("OUTBOXKIT_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres"),
}


CONFTEST = """
import json
import os

DURATIONS = []


def pytest_runtest_logreport(report):
    if report.when == "setup":
        DURATIONS.append(report.duration)
    else:
        DURATIONS[-1] += report.duration
    if report.failed:
        raise SystemExit(f"a benchmark test failed: {report.nodeid}")


def pytest_unconfigure(config):
    with open(os.environ["BENCH_OUT"], "w") as out:
        json.dump(DURATIONS, out)
"""


def run(folder: Path, test_file: str, store: str) -> list[float]:
    """One pytest session of ``test_file``: each test's setup + call + teardown, in seconds."""
    out = folder / "durations.json"
    args = [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider"]
    if store:
        args.append(f"--outbox-store={store}")
    env = {**os.environ, "BENCH_OUT": str(out), "PYTHONPATH": str(folder)}
    env.pop("PYTEST_ADDOPTS", None)
    done = subprocess.run(args, cwd=folder, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"pytest exited with {done.returncode} for {test_file}:\n{done.stdout}")
    durations: list[float] = json.loads(out.read_text())
    return durations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=200, help="tests of each kind per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stores", nargs="+", default=list(STORES), choices=list(STORES))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="outboxkit-bench-") as root:
        folder = Path(root)
        (folder / "benchapp.py").write_text(APP)
        (folder / "test_kit.py").write_text(textwrap.dedent(KIT_TEST.format(tests=args.tests)))
        (folder / "test_direct.py").write_text(DIRECT_TEST.format(tests=args.tests))
        (folder / "conftest.py").write_text(CONFTEST)
        (folder / "pytest.ini").write_text(
            "[pytest]\nasyncio_default_fixture_loop_scope = function\n"
        )
        lines = []
        for name in args.stores:
            kit: list[float] = []
            direct: list[float] = []
            for _ in range(args.rounds):
                kit += run(folder, "test_kit.py", STORES[name])
                direct += run(folder, "test_direct.py", "")
            kit_ms = statistics.median(kit) * 1000
            direct_ms = statistics.median(direct) * 1000
            lines.append(
                f"{name:>6}: kit {kit_ms:6.2f} ms/test, handler called directly "
                f"{direct_ms:5.2f} ms/test, overhead {kit_ms - direct_ms:6.2f} ms "
                f"({kit_ms / direct_ms:.1f}x); {len(kit)} kit tests, {len(direct)} direct"
            )
    print(f"testkit overhead: median per test (setup + call + teardown), {args.rounds} rounds")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
