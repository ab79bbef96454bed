"""``manage.py outboxkit``: the commands on the test database, and two poller processes
delivering 200 events whose handler writes an ORM row (acceptance 3's lock check)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
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
    assert "run, status, dead, purge, migrate, web" in result.stderr
    assert "Traceback" not in result.stderr  # one line, as Django's own commands say it


def test_manage_py_outboxkit_web_serves_the_dashboard(outbox_store):
    enqueue_ticks(2)
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "outboxkit", "web", "--port", "0", "--token", "t" * 12],
        cwd=PROJECT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # blocks until the server listens (or the command ends)
        found = re.search(r"outboxkit dashboard on (http://\S+)/ for DjangoStore", first)
        assert found, first + proc.stderr.read() if proc.stderr else first
        with urllib.request.urlopen(found.group(1) + "/", timeout=30) as response:
            page = response.read().decode()
        assert response.status == 200 and "outboxkit" in page
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err


def test_the_outboxkit_command_loads_the_django_project_with_app():
    """``outboxkit ... --app`` (not manage.py) on a Django project: DJANGO_SETTINGS_MODULE set,
    Django is set up before the app's module is imported."""
    enqueue_ticks(3)
    command = [sys.executable, "-m", "outboxkit", "status", "--json", "--app", "shop.events:outbox"]
    env = {**child_env(), "PYTHONPATH": str(PROJECT)}
    result = subprocess.run(
        command, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=TIMEOUT, check=False
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["pending"] == 3 and data["dead_key"] == "release"
    run = subprocess.run(
        [sys.executable, "-m", "outboxkit", "run", "shop.events:outbox", "--until-idle"],
        cwd=PROJECT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(manage("outboxkit", "status", "--json").stdout)["pending"] == 0
    # Without the settings, the error says what to set.
    unset = {k: v for k, v in env.items() if k != "DJANGO_SETTINGS_MODULE"}
    missing = subprocess.run(
        command,
        cwd=PROJECT,
        env=unset,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert missing.returncode == 2
    assert "a Django project: set DJANGO_SETTINGS_MODULE" in missing.stderr
