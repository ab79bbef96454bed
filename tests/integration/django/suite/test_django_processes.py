"""``manage.py outboxkit``: the commands on the test database, and two poller processes
delivering 200 events whose handler writes an ORM row (acceptance 3's lock check)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.db import connection, transaction
from shop.models import LedgerLine

PROJECT = Path(__file__).resolve().parents[1]
TIMEOUT = 180

pytestmark = pytest.mark.django_db(transaction=True)


def child_env():
    """The test database (committed data, transactional_db) for manage.py children."""
    return {**os.environ, "OUTBOXKIT_DJANGO_NAME": str(connection.settings_dict["NAME"])}


def manage(*args):
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=PROJECT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def enqueue_ticks(count):
    from shop.events import outbox  # the app's own outbox: the system clock, as the children

    with transaction.atomic():
        outbox.enqueue_many(connection, [("tick", {"n": n}) for n in range(count)])


def test_two_poller_processes_deliver_200_events_without_database_is_locked(outbox_store):
    enqueue_ticks(200)
    command = [
        sys.executable,
        "manage.py",
        "outboxkit",
        "run",
        "--until-idle",
        "--batch-size",
        "10",
    ]
    started = time.monotonic()
    children = [
        subprocess.Popen(
            command,
            cwd=PROJECT,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [child.communicate(timeout=TIMEOUT)[0] for child in children]
    wall = time.monotonic() - started
    for child, output in zip(children, outputs, strict=True):
        assert child.returncode == 0, output
        assert "database is locked" not in output
        assert "drained:" in output, output
    stats = outbox_store.stats(now=None)
    events = outbox_store.events()
    records = sum(len(outbox_store.records(e.id)) for e in events)
    rows = LedgerLine.objects.filter(line="tick").count()
    assert (rows, records, stats.published, stats.dead) == (200, 200, 200, 0)
    assert outbox_store.dead_letters() == []
    claimed = [
        line.split("drained: ", 1)[1].split(" claimed")[0]
        for output in outputs
        for line in output.splitlines()
        if "drained:" in line
    ]
    print(
        f"\n2 processes on {connection.vendor}: {wall:.2f}s wall, claimed {claimed}, "
        f"{rows} rows, {records} records, {stats.dead} dead"
    )


def test_status_json_counts_what_the_app_enqueued(outbox_store):
    enqueue_ticks(3)
    result = manage("outboxkit", "status", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["pending"] == 3


def test_migrate_is_idempotent_and_dead_list_is_empty(outbox_store):
    migrate = manage("outboxkit", "migrate")
    assert migrate.returncode == 0, migrate.stderr
    dead = manage("outboxkit", "dead", "list")
    assert dead.returncode == 0, dead.stderr
    assert "no dead letters" in dead.stdout


def test_purge_runs_through_the_outboxkit_command(outbox_store):
    enqueue_ticks(1)
    assert manage("outboxkit", "run", "--until-idle").returncode == 0
    purge = manage("outboxkit", "purge", "--published-older-than", "0s", "--yes")
    assert purge.returncode == 0, purge.stderr
    assert outbox_store.events() == []


def test_run_with_processes_is_refused_clearly():
    result = manage("outboxkit", "run", "--processes", "2")
    assert result.returncode != 0
    assert "start several `manage.py outboxkit run` processes" in result.stderr


def test_an_unknown_command_names_the_commands():
    result = manage("outboxkit", "frobnicate")
    assert result.returncode != 0
    assert "run, status, dead, purge, migrate" in result.stderr
