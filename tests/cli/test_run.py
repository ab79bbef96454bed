"""``outboxkit run`` on SQLite and PostgreSQL: options, where the store comes from, the summary
line, signals (acceptance 3) and supervised processes (acceptance 4).

"Mid-drain" is made deterministic by a handler that waits for a file the test creates (see
``apps.py``); the tests wait for conditions with deadlines, never for a fixed time.
"""

from __future__ import annotations

import os
import re
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from outboxkit import Outbox, Outcome, Poller, PollReport, State, Store
from tests.backends import Target

from .apps import App
from .conftest import Cli, Procs, Result, wait_for


def jobs(store: Store, *payloads: dict[str, Any]) -> list[int]:
    outbox = Outbox(store, load_entry_points=False)
    with store.transaction() as conn:
        return [outbox.enqueue(conn, "job.run", payload) for payload in payloads]


def ok(result: Result) -> None:
    assert result.code == 0, result  # (a failing handler's traceback is logged, as it should)


def pids(started: dict[int, set[int]]) -> set[int]:
    return set().union(*started.values()) if started else set()


# -- one process --------------------------------------------------------------------------------


def test_until_idle_drains_with_the_given_options(
    cli: Cli, target: Target, store: Store, app: App
) -> None:
    jobs(store, *[{}] * 5, {"fail": True})
    result = cli(
        "run",
        app.spec(),
        "--until-idle",
        "--batch-size",
        "2",
        "--interval",
        "50ms",
        "--lease",
        "7s",
        "--max-retries",
        "0",
        "--transaction",
        "per_batch",
        "--prefetch",
    )
    ok(result)
    assert (
        "Poller(batch_size=2, lease=7.0s, interval=0.05s, max_retries=0, "
        "transaction='per_batch', prefetch=True)" in result.stderr
    )
    assert "draining" not in result.stderr  # the progress is drawn on a terminal only
    assert (
        "drained: 6 claimed, 5 published, 0 retried later, 1 dead-lettered, 0 lease(s) lost, "
        "0 released" in result.stderr
    )
    stats = store.stats(now=None)
    assert (stats.published, stats.dead, stats.pending) == (5, 1, 0)


def test_until_idle_drains_through_the_pollers_one_drain_loop(
    tmp_path: Path, target: Target, store: Store, app: App, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs(store, *[{}] * 3, {"fail": True})
    calls: list[list[str]] = []
    reports: list[PollReport] = []
    drain = Poller.run_until_idle

    def spy(self: Poller, **kwargs: Any) -> list[PollReport]:
        calls.append(sorted(kwargs))
        reports.extend(drain(self, **kwargs))
        return reports

    monkeypatch.setattr(Poller, "run_until_idle", spy)
    work = tmp_path / "cwd"
    work.mkdir()
    result = Cli("runner", work, [tmp_path / "app"])("run", app.spec(), "--until-idle")
    ok(result)
    assert calls == [[]]  # the progress is read from the store, not from the rounds
    assert sum(len(r.claimed) for r in reports) == 4
    assert (
        "drained: 4 claimed, 3 published, 1 retried later, 0 dead-lettered, 0 lease(s) lost, "
        "0 released" in result.stderr
    )


def test_until_idle_keeps_the_apps_defaults(
    cli: Cli, target: Target, store: Store, app: App
) -> None:
    (failing,) = jobs(store, {"fail": True})
    result = cli("run", app.spec(), "--until-idle")
    ok(result)
    # The app says max_retries=5 and a one-hour backoff: the failure waits for its retry.
    assert (
        "Poller(batch_size=100, lease=30.0s, interval=0.5s, max_retries=5, "
        "transaction='per_event')" in result.stderr
    )
    assert "1 retried later, 0 dead-lettered" in result.stderr
    event = store.get(failing)
    assert event is not None and event.state is State.PENDING and event.attempts == 1


@pytest.mark.parametrize("where", ["flag", "environment", "app"])
def test_the_store_comes_from_flag_environment_or_app(
    cli: Cli,
    target: Target,
    store: Store,
    app: App,
    monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:
    ids = jobs(store, {}, {})
    env = None
    args: list[str] = []
    if where != "app":  # the app's own store is then an empty in-memory one
        monkeypatch.setenv("CLI_TEST_STORE", "memory://")
        monkeypatch.setenv("CLI_TEST_STORE_OPTIONS", "{}")
        if where == "flag":
            args = target.cli_args()
        else:
            env = {"OUTBOXKIT_STORE": target.url}
            args = target.option_args()
    result = cli("run", app.spec(), "--until-idle", *args, env=env)
    ok(result)
    assert "MemoryStore" not in result.stderr
    for event_id in ids:
        event = store.get(event_id)
        assert event is not None and event.state is State.PUBLISHED, result


def test_log_level(cli: Cli, target: Target, store: Store, app: App) -> None:
    jobs(store, {})
    quiet = cli("run", app.spec(), "--until-idle", "--log-level", "warning")
    ok(quiet)
    assert " INFO " not in quiet.stderr
    jobs(store, {})
    chatty = cli("run", app.spec(), "--until-idle", "--log-level", "DEBUG")
    ok(chatty)
    assert " INFO outboxkit.run: drained: 1 claimed" in chatty.stderr


def test_a_summary_line_is_logged_periodically(
    process_cli: Cli, target: Target, store: Store, app: App, procs: Procs
) -> None:
    jobs(store, {}, {}, {})
    proc = procs.start(
        process_cli, ["run", app.spec(), "--log-every", "100ms", "--interval", "50ms"]
    )
    summary = re.compile(
        r"INFO outboxkit\.run: \d+\.\d published/s, 0 pending, oldest due none, 0 dead, "
        r"0 in flight \(handlers: \d+ succeeded, 0 rejected, 0 failed\)$",
        re.M,
    )
    rate = re.compile(r"[1-9]\d*\.\d published/s")
    # The line after the drain may still show 0.0 published/s: a summary logged while the
    # round was settling counts the events in the next line's rate.
    wait_for(
        lambda: (
            (summary.search(proc.stderr()) and rate.search(proc.stderr()))
            or proc.popen.poll() is not None
        ),
        "a summary line once all is published",
    )
    assert summary.search(proc.stderr()), proc.report()
    assert rate.search(proc.stderr()), proc.report()
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(timeout=10) == 0, proc.report()


def test_successes_and_rejections_per_event_at_debug_counted_at_info(
    cli: Cli, target: Target, store: Store, app: App
) -> None:
    outbox = Outbox(store, load_entry_points=False)
    with store.transaction() as conn:
        for n in range(12):
            outbox.enqueue(conn, "order.placed", {"n": n, "reject": n % 3 == 0})
    quiet = cli("run", app.spec(), "--until-idle")
    assert quiet.code == 0, quiet
    # No line per event at the default level: the count (3 handlers an event), once, at the end.
    assert (
        "rejected it" not in quiet.stderr and "succeeded" not in quiet.stderr.split("(handlers:")[0]
    ), quiet
    assert "(handlers: 32 succeeded, 4 rejected, 0 failed)" in quiet.stderr, quiet
    with store.transaction() as conn:
        outbox.enqueue(conn, "order.placed", {"reject": True})
    loud = cli("run", app.spec(), "--until-idle", "--log-level", "DEBUG")
    assert loud.code == 0, loud
    assert re.search(
        r"DEBUG outboxkit: event \d+ \(order\.placed\): audit rejected it", loud.stderr
    )
    assert re.search(
        r"DEBUG outboxkit: event \d+ \(order\.placed\): reserve succeeded", loud.stderr
    )


# -- signals (acceptance 3) ---------------------------------------------------------------------


def test_sigterm_mid_drain_finishes_the_event_in_hand_and_releases_the_rest(
    process_cli: Cli, target: Target, store: Store, app: App, procs: Procs
) -> None:
    ids = jobs(store, *[{"block": True}] * 5)
    proc = procs.start(
        process_cli, ["run", app.spec(), "--batch-size", "10", "--lease", "60s", "--grace", "30s"]
    )
    wait_for(lambda: app.started() or proc.popen.poll() is not None, "a handler to start")
    (in_hand,) = app.started()  # the first event of the batch; the other four wait behind it
    assert in_hand == ids[0], proc.report()

    proc.popen.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    proc.wait_for_log("SIGTERM received: stopping", timeout=5)
    assert proc.popen.poll() is None  # still finishing the event in hand
    app.gate()
    code = proc.popen.wait(timeout=5)
    elapsed = time.monotonic() - sent
    assert code == 0, proc.report()
    assert elapsed < 5, elapsed
    print(f"SIGTERM to exit 0: {elapsed:.2f}s ({target.backend})")  # shown with -s

    # The event in hand finished: its handler returned and its record and publish committed.
    assert in_hand in app.done()
    assert [(r.handler, r.outcome) for r in store.records(in_hand)] == [("work", Outcome.SUCCEEDED)]
    event = store.get(in_hand)
    assert event is not None and event.state is State.PUBLISHED
    # The rest were released, not left to a 60 s lease: claimable right now, attempt refunded.
    claims = store.claim(batch_size=10, lease=timedelta(seconds=30), now=None)
    assert sorted(c.event.id for c in claims) == ids[1:], proc.report()
    assert {c.attempt for c in claims} == {1}
    assert set(app.started()) == {in_hand}  # none of them was started
    assert "released 4 unstarted claim(s)" in proc.stderr()
    store.release(claims, now=None)


def test_sigint_stops_gracefully_too(
    process_cli: Cli, target: Target, store: Store, app: App, procs: Procs
) -> None:
    ids = jobs(store, {"block": True}, {"block": True})
    proc = procs.start(process_cli, ["run", app.spec(), "--lease", "60s"])
    wait_for(lambda: app.started() or proc.popen.poll() is not None, "a handler to start")
    proc.popen.send_signal(signal.SIGINT)
    proc.wait_for_log("SIGINT received: stopping", timeout=5)
    app.gate()
    assert proc.popen.wait(timeout=5) == 0, proc.report()
    assert set(app.done()) == {ids[0]}
    assert [c.event.id for c in store.claim(batch_size=10, lease=timedelta(1), now=None)] == ids[1:]


def test_the_grace_time_bounds_the_stop(
    process_cli: Cli, target: Target, store: Store, app: App, procs: Procs
) -> None:
    (blocked,) = jobs(store, {"block": True})
    proc = procs.start(process_cli, ["run", app.spec(), "--grace", "300ms", "--lease", "60s"])
    wait_for(lambda: app.started() or proc.popen.poll() is not None, "a handler to start")
    proc.popen.send_signal(signal.SIGTERM)
    code = proc.popen.wait(timeout=10)  # the handler never returns: the grace time ends it
    assert code == 1, proc.report()
    assert "did not stop within the grace time (0.3s)" in proc.stderr()
    assert blocked not in app.done()


def test_a_second_signal_forces_the_exit(
    process_cli: Cli, target: Target, store: Store, app: App, procs: Procs
) -> None:
    jobs(store, {"block": True})
    proc = procs.start(process_cli, ["run", app.spec(), "--grace", "60s", "--lease", "60s"])
    wait_for(lambda: app.started() or proc.popen.poll() is not None, "a handler to start")
    proc.popen.send_signal(signal.SIGTERM)
    proc.wait_for_log("SIGTERM received: stopping", timeout=5)
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(timeout=10) == 1, proc.report()
    assert "second signal (SIGTERM): exiting now" in proc.stderr()


# -- several processes (acceptance 4) -----------------------------------------------------------


def test_processes_drain_until_idle(cli: Cli, target: Target, store: Store, app: App) -> None:
    ids = jobs(store, *[{}] * 20)
    result = cli("run", app.spec(), "--processes", "2", "--until-idle", "--interval", "50ms")
    ok(result)
    assert "poller 1/2 started" in result.stderr and "poller 2/2 started" in result.stderr
    assert "all 2 poller processes stopped" in result.stderr
    assert store.stats(now=None).published == len(ids)


def test_a_killed_poller_process_is_restarted_and_the_drain_completes(
    process_cli: Cli, target: Target, store: Store, app: App, procs: Procs
) -> None:
    ids = jobs(store, *[{"block": True}] * 6)
    supervisor = procs.start(
        process_cli,
        [
            "run",
            app.spec(),
            "--processes",
            "2",
            "--batch-size",
            "1",
            "--lease",
            "3s",
            "--interval",
            "50ms",
            "--grace",
            "20s",
        ],
    )
    # Both children hold one event each, blocked in the handler.
    wait_for(
        lambda: len(pids(app.started())) >= 2 or supervisor.popen.poll() is not None,
        "two poller processes mid-delivery",
    )
    first = pids(app.started())
    assert len(first) == 2, supervisor.report()
    victim = min(first)
    os.kill(victim, signal.SIGKILL)
    supervisor.wait_for_log(f"(pid {victim}) was killed by SIGKILL; restarting it", timeout=10)
    # The replacement takes one of the waiting events (and blocks on it too).
    wait_for(
        lambda: pids(app.started()) - first or supervisor.popen.poll() is not None,
        "the restarted poller process to take an event",
    )
    assert pids(app.started()) - first, supervisor.report()
    app.gate()
    # The killed child's event comes back when its 3 s lease runs out; then all is published.
    wait_for(
        lambda: store.stats(now=None).published == len(ids) or supervisor.popen.poll() is not None,
        "every event published",
        timeout=60,
    )
    assert store.stats(now=None).published == len(ids), supervisor.report()
    for event_id in ids:
        assert ("work", Outcome.SUCCEEDED) in [
            (r.handler, r.outcome) for r in store.records(event_id)
        ]
    started_lines = re.findall(r"poller \d/2 started \(pid (\d+)\)", supervisor.stderr())
    assert len(set(started_lines)) == 3, supervisor.report()

    # SIGTERM reaches the children through the supervisor; all stop cleanly.
    supervisor.popen.send_signal(signal.SIGTERM)
    assert supervisor.popen.wait(timeout=30) == 0, supervisor.report()
    assert "all 2 poller processes stopped" in supervisor.stderr()


def test_a_child_that_fails_on_wrong_input_is_not_restarted(
    process_cli: Cli, tmp_path: Path, procs: Procs
) -> None:
    folder = tmp_path / "app"
    folder.mkdir()
    (folder / "only_here.py").write_text(
        "import os\n"
        "from outboxkit import MemoryStore, Outbox\n"
        "if os.environ.get('OUTBOXKIT_SUPERVISOR_PID'):\n"
        "    raise RuntimeError('this app cannot be imported by a child')\n"
        "outbox = Outbox(MemoryStore())\n"
    )
    supervisor = procs.start(process_cli, ["run", "only_here:outbox", "--processes", "2"])
    assert supervisor.popen.wait(timeout=30) == 2, supervisor.report()
    assert "exited with code 2 (wrong input, see its log)" in supervisor.stderr()
    assert "restarting" not in supervisor.stderr()
