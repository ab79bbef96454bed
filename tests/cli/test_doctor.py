"""``outboxkit doctor``: a planted idle-in-transaction session, a planted stale lease and a
missing migration found on PostgreSQL, each named with its fix; the checks every store answers
(backlog, held keys) on SQLite too; exit 1 on a problem, 0 otherwise; ``--json``.

The shared test server may hold other sessions and settings of its own (its autovacuum may be
off): the PostgreSQL tests look for the finding they planted, and the exit code, not for a
clean bill of health."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outboxkit import EventBus, FrozenClock, Outbox, Store
from outboxkit_pg import PostgresStore
from outboxkit_pg.store import MIGRATIONS
from tests.backends import Target, open_target

from .apps import App
from .conftest import Cli


def _findings(result: Any, check: str) -> list[dict[str, Any]]:
    data = json.loads(result.stdout)
    return [f for f in data["findings"] if f["check"] == check]


@pytest.fixture
def pg_target(tmp_path: Path) -> Iterator[tuple[Target, PostgresStore]]:
    with open_target("pg", tmp_path) as target:
        store = target.open()
        assert isinstance(store, PostgresStore)
        try:
            store.migrate()
            yield target, store
        finally:
            store.close()


@pytest.mark.pg
def test_a_planted_idle_in_transaction_session_is_named_with_its_fix(
    cli: Cli, pg_target: tuple[Target, PostgresStore]
) -> None:
    target, _ = pg_target
    name = f"okt_idle_{uuid.uuid4().hex[:8]}"
    server = target.url.split("?", 1)[0]
    with psycopg.connect(server, application_name=name) as idle:
        idle.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        idle.execute("SELECT 1")  # a snapshot held: idle in transaction, xmin pinned
        pid = idle.info.backend_pid
        result = cli("doctor", "--json", "--transaction-after", "0s", *target.cli_args())
        human = cli("doctor", "--transaction-after", "0s", *target.cli_args())
    assert result.code == 1, result
    ours = [f for f in _findings(result, "transactions") if f["details"].get("pid") == pid]
    assert len(ours) == 1, result.stdout
    [finding] = ours
    assert finding["severity"] == "problem"
    assert finding["details"]["application_name"] == name
    assert finding["details"]["state"] == "idle in transaction"
    assert "holds back vacuum" in finding["summary"]
    assert f"SELECT pg_terminate_backend({pid})" in finding["fix"]
    assert "idle_in_transaction_session_timeout" in finding["fix"]
    assert human.code == 1
    assert f"PROBLEM  transactions: session pid {pid} (" in human.stdout
    assert f"fix: end it (SELECT pg_terminate_backend({pid}))" in human.stdout


@pytest.mark.pg
def test_a_planted_stale_lease_is_named_with_its_fix(
    cli: Cli, pg_target: tuple[Target, PostgresStore]
) -> None:
    target, store = pg_target
    # Enqueued and claimed an hour ago with a 30 s lease: a poller that died, and none since.
    an_hour_ago = datetime.now(UTC) - timedelta(hours=1)
    outbox = Outbox(store, clock=FrozenClock(an_hour_ago), load_entry_points=False)
    with store.transaction() as conn:
        outbox.enqueue(conn, "order.placed", {})
    (claim,) = store.claim(batch_size=1, lease=timedelta(seconds=30), now=an_hour_ago)
    result = cli("doctor", "--json", *target.cli_args())
    assert result.code == 1, result
    [finding] = _findings(result, "stale_leases")
    assert finding["severity"] == "problem"
    assert finding["details"]["events"] == 1
    assert finding["details"]["oldest_seconds"] > 3000
    assert "no poller is running" in finding["summary"]
    assert "outboxkit run" in finding["fix"]
    # Within the limit it is not a problem.
    fresh = cli("doctor", "--json", "--stale-after", "2h", *target.cli_args())
    assert [f["severity"] for f in _findings(fresh, "stale_leases")] == ["ok"]
    assert claim.event.id


@pytest.mark.pg
def test_a_missing_migration_is_named_with_its_fix(
    cli: Cli, pg_target: tuple[Target, PostgresStore]
) -> None:
    target, store = pg_target
    latest, what = MIGRATIONS[-1]  # the newest migration, taken back
    versions = sql.Identifier(store.names.schema, store.names.versions)
    server = target.url.split("?", 1)[0]
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(sql.SQL("DELETE FROM {} WHERE version = %s").format(versions), (latest,))
    result = cli("doctor", "--json", *target.cli_args())
    assert result.code == 1, result
    [migrations] = _findings(result, "migrations")
    assert migrations["severity"] == "problem"
    assert migrations["details"] == {"version": latest - 1, "expected": latest, "missing": [latest]}
    assert f"missing migration(s) {latest}: {what}" in migrations["summary"]
    assert migrations["fix"].startswith("outboxkit migrate --store URL")
    [schema] = _findings(result, "schema")
    assert schema["severity"] == "problem"
    assert f"older than version {latest}" in schema["summary"]
    human = cli("doctor", *target.cli_args())
    assert "PROBLEM  migrations: schema " in human.stdout
    assert "fix: outboxkit migrate --store URL" in human.stdout


@pytest.mark.pg
def test_the_server_checks_report_tables_and_settings(
    cli: Cli, pg_target: tuple[Target, PostgresStore]
) -> None:
    target, _ = pg_target
    result = cli("doctor", "--json", *target.cli_args())
    data = json.loads(result.stdout)
    assert data["result"] in ("ok", "warning", "problem")
    tables = _findings(result, "dead_tuples")
    assert len(tables) == 2  # events and deliveries
    assert all(
        {"live_rows", "dead_rows", "bytes", "index_bytes"} <= set(f["details"]) for f in tables
    )
    settings = _findings(result, "settings")
    assert settings, result.stdout


def _plant(store: Store, *, due_for: timedelta) -> None:
    """One event due since ``due_for`` ago, and one key held by a dead event."""
    bus = EventBus()

    @bus.handler("job", name="fail")
    def fail(event: Any, ctx: Any) -> None:
        raise RuntimeError("down")

    clock = FrozenClock(datetime.now(UTC) - due_for)
    outbox = Outbox(store, bus, clock=clock, max_retries=0, load_entry_points=False)
    with store.transaction() as conn:
        outbox.enqueue(conn, "job", {}, key="k-1")
        outbox.enqueue(conn, "other", {})
    outbox.poller(batch_size=1).run_once()  # "job" dies, holding key k-1


@pytest.mark.parametrize("target", ["sqlite"], indirect=True)
def test_the_stores_checks_on_sqlite_and_the_exit_code(
    cli: Cli, app: App, target: Target, store: Store
) -> None:
    healthy = cli("doctor", "--json", *target.cli_args())
    assert healthy.code == 0, healthy
    assert json.loads(healthy.stdout)["result"] == "ok"
    _plant(store, due_for=timedelta(hours=1))
    found = cli("doctor", "--json", "--app", app.spec("held"))
    assert found.code == 1, found
    [backlog] = _findings(found, "backlog")
    assert backlog["severity"] == "problem" and "outboxkit run" in backlog["fix"]
    [held] = _findings(found, "held_keys")
    assert held["severity"] == "problem" and "'k-1' (dead event" in held["summary"]
    unknown = cli("doctor", "--json", "--backlog-after", "2h", *target.cli_args())
    [held] = _findings(unknown, "held_keys")
    assert held["severity"] == "warning" and "pass --app to know" in held["summary"]
    assert unknown.code == 0, unknown  # warnings only
