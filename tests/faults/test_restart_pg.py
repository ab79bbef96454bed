"""A PostgreSQL server restart mid-drain, twice, through the shared fault harness.

Three pollers drain 600 events over three topics; while they work the server is restarted with
``pg_ctlcluster <version> main restart -m immediate`` (the cluster serving the test server:
``main`` normally; every backend killed, crash recovery on start), once after the first 50
events are published and once after the first 350 (the second half is enqueued after the first
restart). After each restart the test waits, bounded, until the server answers again. The
pollers' pools and ``LISTEN`` connections die with it: each poller sees a ``StoreUnavailable``,
waits the outage out with backoff, and resumes by itself. No poller exits, everything is
published by the running pollers, and each exits 0 when asked to stop. Then a fault-free drain
and the figures: nothing lost, no ledger row twice, nothing stuck or dead, no double claim; the
mailer's duplicates (a mail sent whose delivery record was cut off) at most one per poller per
restart.

Every session here keeps the server's ``synchronous_commit`` (not the tests' usual ``off``): an
immediate shutdown is a crash, and an asynchronous commit acknowledged before it may be lost
(an enqueued event that vanishes is no fault of the pollers). Every connection used after a
restart is opened after it (the ``admin`` fixture's would be dead).

The test restarts the server for everyone: it runs only against a local ``pg_ctlcluster``
cluster, as root or postgres, and before each restart waits (15 s at most) for a moment when no
other client is connected, else skips: on a shared server, point ``OUTBOXKIT_TEST_PG`` at a
cluster of its own (``pg_createcluster 15 faults -p 5439 -- --auth=trust``).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from outboxkit import Outbox
from outboxkit_pg import PostgresStore
from tests.faults._harness import (
    TOPICS,
    drain,
    enqueue,
    figures,
    wait_for_server,
    with_application_name,
)
from tests.integration.pg._workers import Fleet, create_app_tables, wait_until
from tests.integration.pg.conftest import pg_url_from_env

pytestmark = [pytest.mark.pg, pytest.mark.faults]

EVENTS = 600
POLLERS = 3
BATCH = 10
RESTART_AFTER = (50, 350)  # published events before each restart; the second half comes later
CONFIG_ROOT = Path("/etc/postgresql")


def _cluster(url: str) -> tuple[str, str]:
    """The version and name of the local pg_ctlcluster cluster serving ``url`` (``main``
    normally), or skip saying why."""
    if shutil.which("pg_ctlcluster") is None:
        pytest.skip("server restart: pg_ctlcluster is not installed")
    host = conninfo_to_dict(url).get("host") or "localhost"
    if str(host) not in ("127.0.0.1", "localhost", "::1"):
        pytest.skip(f"server restart: the test server ({host}) is not local")
    user = pwd.getpwuid(os.geteuid()).pw_name
    if user not in ("root", "postgres"):
        pytest.skip(f"server restart: needs root or postgres to run pg_ctlcluster, not {user}")
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        row = conn.execute("SHOW data_directory").fetchone()
    data_directory = os.path.realpath(row[0]) if row else ""
    confs = sorted(CONFIG_ROOT.glob("*/*/postgresql.conf")) if CONFIG_ROOT.is_dir() else []
    for conf in confs:
        for line in conf.read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "data_directory":
                path = value.split("#", 1)[0].strip().strip("'")
                if os.path.realpath(path) == data_directory:
                    return conf.parent.parent.name, conf.parent.name
    pytest.skip(
        f"server restart: no cluster under {CONFIG_ROOT} serves the test server "
        f"(data_directory {data_directory!r})"
    )


def _others(url: str, app_name: str) -> list[tuple[Any, ...]]:
    """Client sessions on the server that are not this test's (a restart would kill them)."""
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        return conn.execute(
            "SELECT pid, datname, application_name FROM pg_stat_activity"
            " WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()"
            " AND application_name IS DISTINCT FROM %s",
            (app_name,),
        ).fetchall()


def _restart(url: str, cluster: tuple[str, str], app_name: str) -> None:
    others: list[tuple[Any, ...]] = []

    def alone() -> bool:
        others[:] = _others(url, app_name)
        return not others

    if not wait_until(alone, 15, step=0.5):
        pytest.skip(f"server restart: other clients are connected to the server: {others}")
    command = ["pg_ctlcluster", "--skip-systemctl-redirect", *cluster, "restart"]
    subprocess.run(
        [*command, "-m", "immediate"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert wait_for_server(url, 60), "the server did not answer within 60 s of its restart"


def _published(url: str, schema: str) -> int:
    """Published events, on a connection of its own (-1 while the server cannot answer)."""
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=2) as conn:
            row = conn.execute(
                sql.SQL("SELECT count(*) FROM {} WHERE published_at IS NOT NULL").format(
                    sql.Identifier(schema, "outbox_events")
                )
            ).fetchone()
    except psycopg.Error:
        return -1
    return int(row[0]) if row else -1


def test_server_restarts_mid_drain(
    pg_schema: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    app_name = f"okt_restart_{uuid.uuid4().hex[:8]}"
    url = with_application_name(pg_url_from_env(), app_name)  # the server's synchronous_commit
    cluster = _cluster(url)
    store = PostgresStore(url, schema=pg_schema)
    restarts = 0
    try:
        store.migrate()
        with psycopg.connect(url, autocommit=True) as setup:
            create_app_tables(setup, pg_schema)
        outbox = Outbox(store)
        options = {"batch_size": BATCH, "lease": 2.0, "interval": 0.2}
        with Fleet(url, pg_schema, tmp_path, options, topics=TOPICS) as fleet:
            for _ in range(POLLERS):
                fleet.spawn()
            assert fleet.wait_ready(60), "poller processes did not start"
            enqueue(url, outbox, EVENTS // 2)
            for n, threshold in enumerate(RESTART_AFTER):
                assert wait_until(lambda t=threshold: _published(url, pg_schema) >= t, 60), (
                    f"{threshold} events not published before restart {n + 1}"
                )
                _restart(url, cluster, app_name)
                restarts += 1
                if n == 0:  # on a fresh connection, after the restart
                    enqueue(url, outbox, EVENTS - EVENTS // 2, start=EVENTS // 2)
            resumed = wait_until(lambda: _published(url, pg_schema) == EVENTS, 60)
            published = _published(url, pg_schema)
            alive = len(fleet.live())
            exit_codes = fleet.shutdown()
            logs = fleet.logs()
        assert drain(url, pg_schema, timeout=60)
        with psycopg.connect(url, autocommit=True) as fresh:
            result = figures(fresh, pg_schema, EVENTS, fleet.traces())
    finally:
        store.close()
    outages = logs.count("store unavailable, retrying with backoff")
    recoveries = logs.count("store available again")
    with capsys.disabled():
        print(
            f"\n[faults:restart-pg] {EVENTS} events, {POLLERS} pollers, {restarts} immediate "
            f"restarts of cluster {'/'.join(cluster)} ({outages} outages, {recoveries} recoveries "
            f"logged; {published} published by the running pollers): {result.line()}"
        )
    assert restarts == len(RESTART_AFTER)
    assert resumed, f"the pollers did not resume: {published}/{EVENTS} published"
    assert alive == POLLERS  # no poller died of the restarts
    assert exit_codes == [0] * POLLERS
    assert result.invariants() == (0, 0, 0, 0, 0)
    assert result.dup_ext <= restarts * POLLERS
