"""``outboxkit run --metrics-port``: one ``/metrics`` for the whole supervised group, scraped
during a drain (the supervisor serves prometheus_client's multiprocess files and the store's
gauges; the children only count).

"During a drain" is made deterministic by handlers that wait for gate files (``apps.py``): the
scrapes happen while both children are blocked in a handler, so every count is settled.
"""

from __future__ import annotations

import socket
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from outboxkit import Outbox, Store
from tests.backends import Target

from .apps import App
from .conftest import Cli, Procs, wait_for


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _jobs(store: Store, payloads: list[dict[str, Any]]) -> list[int]:
    outbox = Outbox(store, load_entry_points=False)
    with store.transaction() as conn:
        return [outbox.enqueue(conn, "job.run", payload) for payload in payloads]


def test_one_metrics_port_serves_the_whole_group_during_a_drain(
    process_cli: Cli, target: Target, store: Store, app: App, procs: Procs
) -> None:
    # Two events that block on gate-1 (one per child), ten plain ones, two on gate-2.
    first = _jobs(store, [{"block": True, "gate": "gate-1"}] * 2)
    plain = _jobs(store, [{}] * 10)
    last = _jobs(store, [{"block": True, "gate": "gate-2"}] * 2)
    port = _free_port()
    supervisor = procs.start(
        process_cli,
        [
            "run",
            app.spec(),
            "--processes",
            "2",
            "--batch-size",
            "1",
            "--interval",
            "50ms",
            "--until-idle",
            "--metrics-port",
            str(port),
        ],
    )
    supervisor.wait_for_log(f"serving metrics on http://127.0.0.1:{port}/metrics")

    def holding(ids: list[int]) -> bool:
        started = app.started()
        return all(i in started for i in ids) or supervisor.popen.poll() is not None

    # Both children hold one gate-1 event each.
    wait_for(lambda: holding(first), "both poller processes blocked on gate-1")
    before = _scrape(port)
    assert _value(before, "outboxkit_store_up") == 1
    assert _value(before, "outboxkit_pending_events") == 12, supervisor.report()
    assert _value(before, "outboxkit_in_flight_events") == 2
    succeeded = {"topic": "job.run", "handler": "work", "outcome": "succeeded"}
    assert _value(before, "outboxkit_deliveries_total", **succeeded) == 0

    app.gate("gate-1")
    # Both children went through the plain events and now hold one gate-2 event each.
    wait_for(lambda: holding(last), "both poller processes blocked on gate-2")
    during = _scrape(port)
    started = app.started()
    by_pid: dict[int, int] = {}
    for event_id in first + plain:
        (pid,) = started[event_id]
        by_pid[pid] = by_pid.get(pid, 0) + 1
    assert len(by_pid) == 2, by_pid  # both processes delivered
    # The scrape sums the two processes' counts: every run of the first twelve events.
    assert _value(during, "outboxkit_deliveries_total", **succeeded) == sum(by_pid.values()) == 12
    assert _value(during, "outboxkit_published_total", topic="job.run") == 12
    assert (
        _value(
            during,
            "outboxkit_handler_duration_seconds_count",
            **{"topic": "job.run", "handler": "work"},
        )
        == 12
    )
    assert _value(during, "outboxkit_lag_seconds_count", topic="job.run") == 14  # + 2 started
    assert _value(during, "outboxkit_claim_batch_size_count") == 14
    # The backlog fell, read from the store at the scrape.
    assert (
        _value(during, "outboxkit_pending_events") == 0 < _value(before, "outboxkit_pending_events")
    )
    assert _value(during, "outboxkit_in_flight_events") == 2

    app.gate("gate-2")
    assert supervisor.popen.wait(timeout=60) == 0, supervisor.report()
    log = supervisor.stderr()
    assert "Address already in use" not in log
    assert "all 2 poller processes stopped" in log
    assert store.stats(now=None).published == 14


def test_a_metrics_port_in_use_is_wrong_input_named_in_one_line(
    process_cli: Cli, target: Target, store: Store, app: App
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for processes in ("1", "2"):
            result = process_cli(
                "run",
                app.spec(),
                "--processes",
                processes,
                "--until-idle",
                "--metrics-port",
                str(port),
            )
            assert result.code == 2, result
            assert f"--metrics-port {port}: cannot listen on 127.0.0.1:{port}" in result.stderr
            assert "Traceback" not in result.stderr
            assert "poller 1/2 started" not in result.stderr  # no child was started


def test_one_process_serves_its_own_metrics_during_a_drain(
    process_cli: Cli, target: Target, store: Store, app: App, procs: Procs
) -> None:
    plain = _jobs(store, [{}] * 3)
    (blocked,) = _jobs(store, [{"block": True, "gate": "gate-1"}])
    port = _free_port()
    proc = procs.start(
        process_cli,
        ["run", app.spec(), "--batch-size", "1", "--until-idle", "--metrics-port", str(port)],
    )
    proc.wait_for_log(f"serving metrics on http://127.0.0.1:{port}/metrics")
    wait_for(
        lambda: blocked in app.started() or proc.popen.poll() is not None,
        "the poller blocked on gate-1",
    )
    samples = _scrape(port)
    succeeded = {"topic": "job.run", "handler": "work", "outcome": "succeeded"}
    assert _value(samples, "outboxkit_deliveries_total", **succeeded) == len(plain)
    assert _value(samples, "outboxkit_pending_events") == 0
    assert _value(samples, "outboxkit_in_flight_events") == 1
    assert _value(samples, "outboxkit_oldest_due_age_seconds") == 0  # the only one is leased
    app.gate("gate-1")
    assert proc.popen.wait(timeout=60) == 0, proc.report()
