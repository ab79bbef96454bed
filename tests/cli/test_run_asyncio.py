"""``outboxkit run`` with the asyncio poller: chosen by the app's ``async def`` handlers or by
``--asyncio``, ``--concurrency``, ``--until-idle``, signals and supervised processes.

The essential cases run on an app whose own store is a memory store (the one store with an
asyncio side for now): its events live and die with the one ``outboxkit run`` process, so they
are seeded when the app is imported and their outcome is read from that process's log (see
``ASYNC_APP_SOURCE``) and exit code. The same cases on SQLite and PostgreSQL skip while those
stores have no asyncio side (``capabilities.asyncio`` is false).

"Mid-batch" is made deterministic by a handler that waits for a file the test creates; the
tests wait for conditions with deadlines, never for a fixed time.
"""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from outboxkit import Outbox, Outcome, State, Store
from outboxkit.aio import AsyncPoller
from outboxkit.cli.runner import RunSettings
from outboxkit.core.model import PollReport
from tests.backends import Target

from .apps import APP_SOURCE, ASYNC_APP_SOURCE, App, dumped, write_app
from .conftest import Cli, Procs, Result, wait_for

ASYNC_POLLER = (
    "AsyncPoller(batch_size={batch}, lease={lease}s, interval=0.5s, max_retries=5, "
    "transaction='per_event', concurrency={concurrency})"
)


def ok(result: Result) -> None:
    assert result.code == 0, result


def wrong_input(result: Result, *fragments: str) -> None:
    """Exit 2 with one line on stderr, no traceback."""
    assert result.code == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result
    assert "Traceback" not in result.stdout + result.stderr, result
    for fragment in fragments:
        assert fragment in lines[0], result


def seed(monkeypatch: pytest.MonkeyPatch, *events: tuple[str, dict[str, Any]]) -> None:
    """Events the memory app enqueues when it is imported (in the ``outboxkit run`` process)."""
    monkeypatch.setenv("CLI_TEST_SEED", json.dumps(events))


def jobs(*payloads: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [("job.run", payload) for payload in payloads]


@pytest.fixture
def memory_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[App]:
    """The asyncio test app on a memory store of its own."""
    written = write_app(tmp_path / "app", ASYNC_APP_SOURCE)
    monkeypatch.setenv("CLI_TEST_STORE", "memory://")
    monkeypatch.setenv("CLI_TEST_STORE_OPTIONS", "{}")
    monkeypatch.syspath_prepend(str(written.folder))
    yield written
    sys.modules.pop(written.name, None)


@pytest.fixture
def blocking_memory_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[App]:
    """The blocking test app (``APP_SOURCE``) on a memory store of its own."""
    written = write_app(tmp_path / "app", APP_SOURCE)
    monkeypatch.setenv("CLI_TEST_STORE", "memory://")
    monkeypatch.setenv("CLI_TEST_STORE_OPTIONS", "{}")
    monkeypatch.syspath_prepend(str(written.folder))
    yield written
    sys.modules.pop(written.name, None)


# -- choosing the poller ------------------------------------------------------------------------


def test_until_idle_runs_the_asyncio_poller_for_an_app_with_async_handlers(
    cli: Cli, memory_app: App, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(
        monkeypatch,
        ("order.placed", {"n": 1}),
        ("order.placed", {"n": 2}),
        ("order.placed", {"n": 3}),
        *jobs({}, {}, {"fail": True}),
    )
    result = cli("run", memory_app.spec(), "--until-idle", "--concurrency", "4", "--lease", "7s")
    ok(result)
    assert ASYNC_POLLER.format(batch=100, lease=7.0, concurrency=4) in result.stderr, result
    assert "draining" not in result.stderr  # the progress is drawn on a terminal only
    # Three orders and their three follow-ups (a later round), three jobs; the failing job
    # waits for its retry an hour later (the app's backoff).
    assert (
        "drained: 9 claimed, 8 published, 1 retried later, 0 dead-lettered, 0 lease(s) lost, "
        "0 released" in result.stderr
    ), result
    if cli.mode == "runner":  # the same process: its memory store can be read here
        store = memory_app.load().store
        stats = store.stats(now=None)
        assert (stats.published, stats.pending, stats.dead) == (8, 1, 0)


def test_the_asyncio_flag_runs_the_asyncio_poller_for_blocking_handlers(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "app"
    folder.mkdir()
    (folder / "plain_app.py").write_text(
        "import threading\n"
        "from outboxkit import EventBus, MemoryStore, Outbox\n"
        "bus = EventBus()\n"
        "threads = []\n"
        "@bus.handler('job.run', name='work', transactional=False)\n"
        "def work(event, ctx):\n"
        "    threads.append(threading.current_thread().name)\n"
        "store = MemoryStore()\n"
        "outbox = Outbox(store, bus)\n"
        "with store.transaction() as tx:\n"
        "    for n in range(3):\n"
        "        outbox.enqueue(tx, 'job.run', {'n': n})\n"
    )
    monkeypatch.syspath_prepend(str(folder))
    try:
        result = cli("run", "plain_app:outbox", "--until-idle", "--asyncio")
        ok(result)
        assert "with AsyncPoller(" in result.stderr, result
        assert "drained: 3 claimed, 3 published" in result.stderr, result
        if cli.mode == "runner":
            # A blocking handler runs in a worker thread of the loop, never on the loop's own.
            threads = sys.modules["plain_app"].threads
            assert len(threads) == 3 and "outboxkit-poller" not in threads
    finally:
        sys.modules.pop("plain_app", None)


def test_an_app_without_async_handlers_keeps_the_blocking_poller(
    cli: Cli, blocking_memory_app: App
) -> None:
    result = cli("run", blocking_memory_app.spec(), "--until-idle")
    ok(result)
    assert "with Poller(" in result.stderr and "AsyncPoller" not in result.stderr, result


def test_concurrency_without_asyncio_goes_to_the_blocking_poller(
    cli: Cli, blocking_memory_app: App
) -> None:
    result = cli("run", blocking_memory_app.spec(), "--until-idle", "--concurrency", "2")
    ok(result)
    assert "with Poller(" in result.stderr and "concurrency=2" in result.stderr, result


def test_asyncio_refuses_a_blocking_transactional_handler_in_one_line(
    cli: Cli, blocking_memory_app: App
) -> None:
    result = cli("run", blocking_memory_app.spec(), "--until-idle", "--asyncio")
    wrong_input(result, "handler 'reserve' (topic 'order.placed') is a blocking transactional")


def test_concurrency_is_refused_with_per_batch_in_one_line(cli: Cli, memory_app: App) -> None:
    result = cli(
        "run", memory_app.spec(), "--until-idle", "--concurrency", "2", "--transaction", "per_batch"
    )
    wrong_input(result, "transaction='per_batch'", "concurrency=2")


@pytest.mark.parametrize("value", ["0", "1001", "many"])
def test_a_bad_concurrency_is_refused_in_one_line(cli: Cli, memory_app: App, value: str) -> None:
    wrong_input(cli("run", memory_app.spec(), "--concurrency", value), "'--concurrency'")


def test_an_asyncio_app_on_a_store_without_an_asyncio_side_is_refused_in_one_line(
    cli: Cli, memory_app: App
) -> None:
    # A SQLite database in memory has no asyncio side (aiosqlite's thread cannot share its one
    # connection).
    url = "sqlite://:memory:"
    result = cli("run", memory_app.spec(), "--until-idle", "--store", url)
    wrong_input(
        result,
        "async def handlers ('reserve', 'ship', 'work') need the asyncio poller",
        "capabilities.asyncio is false",
    )


def test_until_idle_drains_through_the_asyncio_pollers_one_drain_loop(
    tmp_path: Path, memory_app: App, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(monkeypatch, *jobs({}, {}, {"fail": True}))
    calls: list[list[str]] = []
    reports: list[PollReport] = []
    drain = AsyncPoller.run_until_idle

    async def spy(self: AsyncPoller, **kwargs: Any) -> list[PollReport]:
        calls.append(sorted(kwargs))
        reports.extend(await drain(self, **kwargs))
        return reports

    monkeypatch.setattr(AsyncPoller, "run_until_idle", spy)
    work = tmp_path / "cwd"
    work.mkdir()
    result = Cli("runner", work, [tmp_path / "app"])("run", memory_app.spec(), "--until-idle")
    ok(result)
    assert calls == [[]]  # the progress is read from the store, not from the rounds
    assert sum(len(r.claimed) for r in reports) == 3
    assert "drained: 3 claimed, 2 published, 1 retried later" in result.stderr


def test_children_get_the_asyncio_flags() -> None:
    settings = RunSettings(
        app="app:outbox",
        store_url=None,
        store_options=(),
        poller_options={"batch_size": 5},
        asyncio=True,
        concurrency=8,
        until_idle=True,
    )
    argv = settings.child_argv()
    assert argv[argv.index("--asyncio") :][:1] == ["--asyncio"]
    assert argv[argv.index("--concurrency") + 1] == "8"
    plain = RunSettings(app="app:outbox", store_url=None, store_options=(), poller_options={})
    assert "--asyncio" not in plain.child_argv() and "--concurrency" not in plain.child_argv()


# -- signals, on the memory store ----------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_batch_finishes_the_events_in_hand_and_releases_the_rest(
    process_cli: Cli,
    memory_app: App,
    procs: Procs,
    monkeypatch: pytest.MonkeyPatch,
    sig: signal.Signals,
) -> None:
    seed(monkeypatch, *jobs(*[{"block": True}] * 5))
    monkeypatch.setenv("CLI_TEST_DUMP", "1")
    args = ["run", memory_app.spec(), "--batch-size", "10", "--lease", "60s", "--concurrency", "2"]
    proc = procs.start(process_cli, args)
    wait_for(
        lambda: len(memory_app.started()) >= 2 or proc.popen.poll() is not None,
        "two handlers to start",
    )
    in_hand = sorted(memory_app.started())
    assert in_hand == [1, 2], proc.report()  # two at once; the other three wait behind them

    proc.popen.send_signal(sig)
    sent = time.monotonic()
    proc.wait_for_log(f"{sig.name} received: stopping", timeout=5)
    assert proc.popen.poll() is None  # still finishing the events in hand
    memory_app.gate()
    code = proc.popen.wait(timeout=5)
    elapsed = time.monotonic() - sent
    assert code == 0, proc.report()
    assert elapsed < 5, elapsed
    log = proc.stderr()
    assert ASYNC_POLLER.format(batch=10, lease=60.0, concurrency=2) in log
    assert "released 3 unstarted claim(s)" in log and "stopped cleanly" in log, proc.report()

    events = dumped(log)
    # The events in hand finished: their handlers returned, records and publishes committed.
    for event_id in in_hand:
        assert events[event_id]["state"] == "published", events
        assert events[event_id]["records"] == [["work", "succeeded"]]
    assert set(memory_app.done()) == set(in_hand)
    # The rest were released, not left to a 60 s lease: no lease, attempt refunded, unstarted.
    for event_id in (3, 4, 5):
        assert events[event_id] == {
            "id": event_id,
            "topic": "job.run",
            "state": "pending",
            "attempts": 0,
            "leased": False,
            "records": [],
        }, events
    assert set(memory_app.started()) == set(in_hand)


def test_the_grace_time_bounds_the_stop(
    process_cli: Cli, memory_app: App, procs: Procs, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(monkeypatch, *jobs({"block": True}))
    proc = procs.start(process_cli, ["run", memory_app.spec(), "--grace", "300ms"])
    wait_for(lambda: memory_app.started() or proc.popen.poll() is not None, "a handler to start")
    proc.popen.send_signal(signal.SIGTERM)
    code = proc.popen.wait(timeout=10)  # the handler never returns: the grace time ends it
    assert code == 1, proc.report()
    assert "did not stop within the grace time (0.3s)" in proc.stderr()
    assert memory_app.done() == {}


def test_a_second_signal_forces_the_exit(
    process_cli: Cli, memory_app: App, procs: Procs, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(monkeypatch, *jobs({"block": True}))
    proc = procs.start(process_cli, ["run", memory_app.spec(), "--grace", "60s"])
    wait_for(lambda: memory_app.started() or proc.popen.poll() is not None, "a handler to start")
    proc.popen.send_signal(signal.SIGTERM)
    proc.wait_for_log("SIGTERM received: stopping", timeout=5)
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(timeout=10) == 1, proc.report()
    assert "second signal (SIGTERM): exiting now" in proc.stderr()


def test_run_forever_polls_again_when_idle_and_stops_on_sigterm(
    process_cli: Cli, memory_app: App, procs: Procs, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(monkeypatch, ("order.placed", {"n": 1}))
    monkeypatch.setenv("CLI_TEST_DUMP", "1")
    proc = procs.start(
        process_cli, ["run", memory_app.spec(), "--log-every", "100ms", "--interval", "50ms"]
    )
    summary = re.compile(
        r"published/s, 0 pending, oldest due none, 0 dead, 0 in flight \(handlers: .*\)$", re.M
    )
    wait_for(
        lambda: summary.search(proc.stderr()) or proc.popen.poll() is not None,
        "a summary line once all is published",
    )
    assert summary.search(proc.stderr()), proc.report()
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(timeout=10) == 0, proc.report()
    events = dumped(proc.stderr())
    assert [e["state"] for e in events.values()] == ["published", "published"]  # + follow-up


def test_supervised_children_run_the_asyncio_poller_with_the_same_flags(
    process_cli: Cli, memory_app: App, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each child imports the app and so drains a memory store of its own, seeded alike.
    seed(monkeypatch, *jobs({}, {}))
    result = process_cli(
        "run", memory_app.spec(), "--processes", "2", "--until-idle", "--concurrency", "3"
    )
    ok(result)
    for child in ("1/2", "2/2"):
        assert re.search(
            rf"\[poller {child} pid \d+\] .*with AsyncPoller\(.*concurrency=3\)", result.stderr
        ), result
    assert len(re.findall(r"drained: 2 claimed, 2 published", result.stderr)) == 2, result
    assert "all 2 poller processes stopped" in result.stderr


# -- the same on SQLite and PostgreSQL ------------------------------------------------------------


@pytest.fixture
def async_app(
    tmp_path: Path, target: Target, monkeypatch: pytest.MonkeyPatch, store: Store
) -> Iterator[App]:
    """The asyncio test app on the target store (migrated)."""
    if target.backend == "mysql":
        pytest.skip("the MySQL store declares no asyncio side (capabilities.asyncio is false)")
    assert store.capabilities.asyncio, f"{type(store).__name__} lost its asyncio side"
    written = write_app(tmp_path / "app", ASYNC_APP_SOURCE)
    for name, value in target.app_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.syspath_prepend(str(written.folder))
    yield written
    module = sys.modules.pop(written.name, None)
    if module is not None:
        module.store.close()


def enqueue_jobs(store: Store, *payloads: dict[str, Any]) -> list[int]:
    outbox = Outbox(store, load_entry_points=False)
    with store.transaction() as conn:
        return [outbox.enqueue(conn, "job.run", payload) for payload in payloads]


def test_until_idle_with_async_handlers_on_the_target(
    cli: Cli, target: Target, store: Store, async_app: App
) -> None:
    enqueue_jobs(store, *[{}] * 5, {"fail": True})
    result = cli("run", async_app.spec(), "--until-idle", "--concurrency", "4")
    ok(result)
    assert "concurrency=4)" in result.stderr, result
    assert "drained: 6 claimed, 5 published, 1 retried later" in result.stderr, result
    stats = store.stats(now=None)
    assert (stats.published, stats.pending) == (5, 1)


def test_sigterm_mid_batch_on_the_target(
    process_cli: Cli, target: Target, store: Store, async_app: App, procs: Procs
) -> None:
    ids = enqueue_jobs(store, *[{"block": True}] * 5)
    proc = procs.start(
        process_cli,
        ["run", async_app.spec(), "--batch-size", "10", "--lease", "60s", "--concurrency", "2"],
    )
    wait_for(
        lambda: len(async_app.started()) >= 2 or proc.popen.poll() is not None,
        "two handlers to start",
    )
    in_hand = sorted(async_app.started())
    assert in_hand == ids[:2], proc.report()
    proc.popen.send_signal(signal.SIGTERM)
    proc.wait_for_log("SIGTERM received: stopping", timeout=5)
    assert proc.popen.poll() is None
    async_app.gate()
    assert proc.popen.wait(timeout=5) == 0, proc.report()
    for event_id in in_hand:
        event = store.get(event_id)
        assert event is not None and event.state is State.PUBLISHED
        assert [(r.handler, r.outcome) for r in store.records(event_id)] == [
            ("work", Outcome.SUCCEEDED)
        ]
    claims = store.claim(batch_size=10, lease=timedelta(seconds=30), now=None)
    assert sorted(c.event.id for c in claims) == ids[2:], proc.report()
    assert {c.attempt for c in claims} == {1}
    assert "released 3 unstarted claim(s)" in proc.stderr()
    store.release(claims, now=None)


def test_processes_drain_until_idle_with_asyncio_on_the_target(
    cli: Cli, target: Target, store: Store, async_app: App
) -> None:
    ids = enqueue_jobs(store, *[{}] * 20)
    result = cli("run", async_app.spec(), "--processes", "2", "--until-idle", "--interval", "50ms")
    ok(result)
    assert "all 2 poller processes stopped" in result.stderr
    assert store.stats(now=None).published == len(ids)
