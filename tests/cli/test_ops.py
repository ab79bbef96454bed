"""``outboxkit migrate | status | dead ... | purge`` on SQLite and PostgreSQL, through click's
CliRunner and a real subprocess (every test runs four ways)."""

from __future__ import annotations

import json
import os
import pty
import re
import sqlite3
import subprocess
from contextlib import closing
from datetime import timedelta
from pathlib import Path

import pytest

from outboxkit import State, Store
from tests.backends import Target

from .apps import App, Seeded, seed
from .conftest import Cli


@pytest.fixture
def seeded(store: Store, app: App) -> Seeded:
    return seed(store, app.bus)


def ok(result: object) -> None:
    assert getattr(result, "code", None) == 0, result
    assert "Traceback" not in str(result), result


def _schema_version(target: Target) -> int:
    if target.backend == "pg":
        from outboxkit_pg.store import SCHEMA_VERSION
    elif target.backend == "mysql":
        from outboxkit_mysql.store import SCHEMA_VERSION
    else:
        from outboxkit_sqlite.schema import SCHEMA_VERSION
    return SCHEMA_VERSION


def test_migrate_creates_the_schema_and_says_so(cli: Cli, target: Target) -> None:
    before = cli("status", *target.cli_args())
    # No schema yet: on PostgreSQL and MySQL a store failure (exit 1), on SQLite no file at
    # all, which status does not create (wrong input, exit 2); all name the command that makes
    # one.
    assert before.code == (2 if target.backend == "sqlite" else 1), before
    assert "`outboxkit migrate`" in before.stderr, before
    assert len(before.stderr.strip().splitlines()) == 1, before
    version = _schema_version(target)
    result = cli("migrate", *target.cli_args())
    ok(result)
    assert result.stdout.startswith(f"created schema v{version}: "), result
    again = cli("migrate", *target.cli_args())  # idempotent
    ok(again)
    assert again.stdout.startswith(f"already at v{version}: "), again
    after = cli("status", "--json", *target.cli_args())
    ok(after)
    assert json.loads(after.stdout)["total"] == 0


def test_read_only_commands_create_no_database(cli: Cli, tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    for command in (["status"], ["dead", "list"], ["dead", "show", "1"]):
        result = cli(*command, "--store", f"sqlite:///{missing}")
        assert result.code == 2, result
        assert f"there is no SQLite database {missing}" in result.stderr, result
        assert "`outboxkit migrate`" in result.stderr, result
        assert not missing.exists(), result


def test_status_counts_by_state_and_topic(cli: Cli, target: Target, seeded: Seeded) -> None:
    result = cli("status", "--json", *target.cli_args())
    ok(result)
    data = json.loads(result.stdout)
    assert (data["pending"], data["in_flight"], data["published"], data["dead"]) == (3, 0, 3, 2)
    assert data["by_topic"] == {
        "invoice.due": {"pending": 1, "in_flight": 0, "published": 0, "dead": 1},
        "order.placed": {"pending": 2, "in_flight": 0, "published": 3, "dead": 1},
    }
    # The oldest due event has waited a minute; the retry parked since two hours ago (due
    # tomorrow) is not due, so it does not count.
    assert 59 <= data["oldest_due_age_seconds"] < 600, data

    human = cli("status", *target.cli_args())
    ok(human)
    assert "3 pending, 0 in flight (leased), 3 published, 2 dead" in human.stdout
    assert "dead letters: 2" in human.stdout
    assert re.search(r"^oldest due: 1\.\dm ago ", human.stdout, flags=re.M), human
    rows = {line.split()[0]: line.split()[1:] for line in human.stdout.splitlines()[-2:]}
    assert rows == {"invoice.due": ["1", "0", "0", "1"], "order.placed": ["2", "0", "3", "1"]}


def test_status_shows_leases_in_flight(
    cli: Cli, target: Target, store: Store, seeded: Seeded
) -> None:
    (claim,) = store.claim(batch_size=1, lease=timedelta(minutes=5), now=None)
    assert claim.event.id == seeded.due[0]
    data = json.loads(cli("status", "--json", *target.cli_args()).stdout)
    assert (data["pending"], data["in_flight"]) == (2, 1)
    human = cli("status", *target.cli_args()).stdout
    assert "in-flight leases: 1" in human


def _hold_one_key(store: Store) -> int:
    """Two events of key ``order-1``; the first dies (under ``dead_key="hold"`` the second
    waits). Returns the dead event's id."""
    from outboxkit import EventBus, Outbox

    bus = EventBus()

    @bus.handler("order.placed", name="h")
    def fail(event: object, ctx: object) -> None:
        raise RuntimeError("down")

    outbox = Outbox(store, bus, max_retries=0, dead_key="hold", load_entry_points=False)
    with store.transaction() as conn:
        outbox.enqueue(conn, "order.placed", {"n": 1}, key="order-1")
        outbox.enqueue(conn, "order.placed", {"n": 2}, key="order-1")
    (dead_id,) = outbox.poller().run_once().dead_lettered  # the key's head; the key waits
    return dead_id


def test_status_names_held_keys_with_their_dead_event_under_the_apps_hold_policy(
    cli: Cli, target: Target, store: Store, app: App
) -> None:
    dead_id = _hold_one_key(store)
    data = json.loads(cli("status", "--json", "--app", app.spec("held")).stdout)
    assert (data["dead_key"], data["held_keys"], data["dead_keys"]) == ("hold", 1, 1)
    assert (data["dead"], data["pending"]) == (1, 1)
    [entry] = data["keys_with_a_dead_event"]
    assert (entry["key"], entry["event_id"], entry["topic"]) == ("order-1", dead_id, "order.placed")
    human = cli("status", "--app", app.spec("held")).stdout
    assert "dead-key policy: dead_key='hold' (the app's)" in human
    assert "keys with a dead event: 1 (held: their later events wait" in human
    assert f"key 'order-1': dead event {dead_id} (order.placed, failed " in human
    # The same store, the app's outbox under "release": nothing is held.
    released = json.loads(cli("status", "--json", "--app", app.spec()).stdout)
    assert (released["dead_key"], released["held_keys"], released["dead_keys"]) == (
        "release",
        0,
        1,
    )


def test_status_states_the_policy_unknown_without_the_app(
    cli: Cli, target: Target, store: Store
) -> None:
    dead_id = _hold_one_key(store)
    data = json.loads(cli("status", "--json", *target.cli_args()).stdout)
    # A bare store URL: the store does not record the app's dead_key; never guessed.
    assert (data["dead_key"], data["held_keys"], data["dead_keys"]) == (None, None, 1)
    assert data["keys_with_a_dead_event"][0]["event_id"] == dead_id
    human = cli("status", *target.cli_args()).stdout
    assert "dead-key policy: unknown (the store does not record the app's dead_key" in human
    assert "keys with a dead event: 1 (held only if the app's dead_key is 'hold')" in human
    assert f"key 'order-1': dead event {dead_id}" in human


def test_dead_list_names_the_key_each_dead_letter_holds(
    cli: Cli, target: Target, store: Store, app: App
) -> None:
    dead_id = _hold_one_key(store)
    human = cli("dead", "list", "--app", app.spec("held")).stdout
    [row] = [
        line for line in human.splitlines() if line.split()[:2] == [str(dead_id), "order.placed"]
    ]
    assert "order-1 (held)" in row
    assert "keys with a dead event: 1 (held: their later events wait" in human
    unknown = cli("dead", "list", *target.cli_args()).stdout
    assert "order-1" in unknown and "(held)" not in unknown
    assert "dead-key policy: unknown" in unknown
    [letter] = json.loads(cli("dead", "list", "--json", "--app", app.spec("held")).stdout)
    assert (letter["id"], letter["key"], letter["key_held"]) == (dead_id, "order-1", True)
    [letter] = json.loads(cli("dead", "list", "--json", *target.cli_args()).stdout)
    assert letter["key_held"] is None


def test_ops_find_the_store_by_app_or_environment(
    cli: Cli, target: Target, app: App, seeded: Seeded
) -> None:
    by_app = cli("status", "--json", "--app", app.spec())
    ok(by_app)
    by_env = cli("status", "--json", *target.option_args(), env={"OUTBOXKIT_STORE": target.url})
    ok(by_env)
    by_flag = cli("status", "--json", *target.cli_args())
    counts = [
        {
            k: v
            for k, v in json.loads(r.stdout).items()
            # The policy is known with the app only (see test_status_states_the_policy_...).
            if k not in ("now", "oldest_due_age_seconds", "dead_key", "held_keys")
        }
        for r in (by_app, by_env, by_flag)
    ]
    assert counts[0] == counts[1] == counts[2]
    assert counts[0]["dead"] == 2
    # --store wins over the app's own store: an empty in-memory one here.
    rebound = cli("status", "--json", "--app", app.spec(), "--store", "memory://")
    ok(rebound)
    assert json.loads(rebound.stdout)["total"] == 0


def test_dead_list(cli: Cli, target: Target, seeded: Seeded) -> None:
    def ids(*args: str) -> list[int]:
        result = cli("dead", "list", "--json", *args, *target.cli_args())
        ok(result)
        return [d["id"] for d in json.loads(result.stdout)]

    assert ids() == [seeded.dead_old, seeded.dead_new]  # oldest failure first
    assert ids("--topic", "invoice.due") == [seeded.dead_new]
    assert ids("--since", "2h") == [seeded.dead_new]
    since = (seeded.now - timedelta(days=5)).isoformat().replace("+00:00", "Z")
    assert ids("--since", since) == [seeded.dead_new]
    assert ids("--since", "30d") == [seeded.dead_old, seeded.dead_new]
    assert ids("--limit", "1") == [seeded.dead_old]
    assert ids("--topic", "nothing.here") == []

    (first, _) = json.loads(cli("dead", "list", "--json", *target.cli_args()).stdout)
    assert first["topic"] == "order.placed"
    assert first["payload"] == {"fail": 1, "reject": 1}
    assert first["attempts"] == 1
    assert first["last_error"] == "mail: RuntimeError: mail bounced"
    assert {(r["handler"], r["outcome"]) for r in first["records"]} == {
        ("reserve", "succeeded"),
        ("audit", "rejected"),
    }

    human = cli("dead", "list", *target.cli_args())
    ok(human)
    lines = human.stdout.splitlines()
    assert lines[0].split() == ["ID", "TOPIC", "ATTEMPTS", "FAILED", "AT", "KEY", "LAST", "ERROR"]
    assert lines[1].split()[:3] == [str(seeded.dead_old), "order.placed", "1"]
    assert "card declined" in lines[2]
    assert lines[-1] == "2 dead letter(s)"
    empty = cli("dead", "list", "--topic", "nothing.here", *target.cli_args())
    assert empty.stdout.strip() == "no dead letters"


def test_dead_show(cli: Cli, target: Target, app: App, seeded: Seeded) -> None:
    result = cli("dead", "show", str(seeded.dead_old), *target.cli_args())
    ok(result)
    out = result.stdout
    assert f"dead letter {seeded.dead_old} (order.placed)" in out
    assert "attempts:   1" in out
    assert "last error: mail: RuntimeError: mail bounced" in out
    assert "reserve: succeeded on attempt 1" in out
    assert "audit: rejected on attempt 1: audit says no" in out
    assert '"fail": 1,' in out and '"reject": 1' in out
    # With the app, the handler that has no record (and would run again) is named too.
    with_app = cli("dead", "show", str(seeded.dead_old), "--app", app.spec(), *target.cli_args())
    ok(with_app)
    assert "mail: no record (runs again if requeued)" in with_app.stdout

    as_json = json.loads(
        cli("dead", "show", str(seeded.dead_old), "--json", "--app", app.spec()).stdout
    )
    assert as_json["id"] == seeded.dead_old
    assert as_json["handlers_without_record"] == ["mail"]
    assert [r["handler"] for r in as_json["records"]] == ["reserve", "audit"]
    plain = json.loads(
        cli("dead", "show", str(seeded.dead_new), "--json", *target.cli_args()).stdout
    )
    assert plain["last_error"] == "bill: RuntimeError: card declined"
    assert plain["handlers_without_record"] is None  # unknown without --app


SNAPSHOT_LINE = (
    r"requeued {count} dead letter\(s\) \(dead at \d{{4}}-\d\d-\d\dT[0-9:.]+\+00:00; "
    r"any that fail again stay dead\)"
)
"""What ``dead requeue --all`` says: the count, and the instant of its snapshot (store clock)."""


def test_dead_requeue(cli: Cli, target: Target, store: Store, seeded: Seeded) -> None:
    result = cli("dead", "requeue", str(seeded.dead_old), *target.cli_args())
    ok(result)
    assert result.stdout.strip() == "requeued 1 dead letter(s)"
    event = store.get(seeded.dead_old)
    assert event is not None and event.state is State.PENDING and event.attempts == 0
    assert {r.handler for r in store.records(seeded.dead_old)} == {"reserve", "audit"}  # stay done

    none_left = cli(
        "dead", "requeue", "--all", "--topic", "order.placed", "--yes", *target.cli_args()
    )
    assert re.fullmatch(SNAPSHOT_LINE.format(count=0), none_left.stdout.strip()), none_left
    every = cli("dead", "requeue", "--all", "--yes", *target.cli_args())
    ok(every)
    assert re.fullmatch(SNAPSHOT_LINE.format(count=1), every.stdout.strip()), every
    assert store.stats(now=None).dead == 0


def test_dead_requeue_all_of_a_topic(
    cli: Cli, target: Target, store: Store, seeded: Seeded
) -> None:
    result = cli("dead", "requeue", "--all", "--topic", "invoice.due", "--yes", *target.cli_args())
    ok(result)
    assert re.fullmatch(SNAPSHOT_LINE.format(count=1), result.stdout.strip()), result
    assert [d.event.id for d in store.dead_letters()] == [seeded.dead_old]


def test_dead_purge(cli: Cli, target: Target, store: Store, seeded: Seeded) -> None:
    result = cli("dead", "purge", str(seeded.dead_new), "--yes", *target.cli_args())
    ok(result)
    assert result.stdout.strip() == "purged 1 dead letter(s)"
    assert store.get(seeded.dead_new) is None

    old = cli("dead", "purge", "--older-than", "5d", "--yes", *target.cli_args())
    ok(old)
    assert old.stdout.strip() == "purged 1 dead letter(s)"
    assert store.get(seeded.dead_old) is None
    assert store.records(seeded.dead_old) == []
    stats = store.stats(now=None)
    assert (stats.dead, stats.published, stats.pending) == (0, 3, 3)  # nothing else touched


def test_purge_published(cli: Cli, target: Target, store: Store, seeded: Seeded) -> None:
    result = cli("purge", "--published-older-than", "7d", "--yes", *target.cli_args())
    ok(result)
    assert result.stdout.strip() == "purged 2 published event(s) older than 7d"
    for event_id in seeded.published_old:
        assert store.get(event_id) is None
        assert store.records(event_id) == []
    stats = store.stats(now=None)
    assert (stats.published, stats.dead, stats.pending) == (1, 2, 3)

    recent = cli("purge", "--published-older-than", "30m", "--yes", *target.cli_args())
    assert recent.stdout.strip() == "purged 1 published event(s) older than 30m"
    stats = store.stats(now=None)
    assert (stats.published, stats.dead, stats.pending) == (0, 2, 3)  # dead and pending stay


DESTRUCTIVE = [
    pytest.param(["purge", "--published-older-than", "7d"], "purge", 2, id="purge"),
    pytest.param(["dead", "purge", "--older-than", "5d"], "dead purge", 1, id="dead-purge-older"),
    pytest.param(["dead", "requeue", "--all"], "dead requeue --all", 2, id="dead-requeue-all"),
]


def _everything(store: Store) -> list[object]:
    events = store.events(limit=1000)
    return [(e, store.records(e.id)) for e in events]


@pytest.mark.parametrize(("command", "name", "count"), DESTRUCTIVE)
def test_a_dry_run_counts_and_changes_nothing(
    cli: Cli,
    target: Target,
    store: Store,
    seeded: Seeded,
    command: list[str],
    name: str,
    count: int,
) -> None:
    before = _everything(store)
    result = cli(*command, "--dry-run", *target.cli_args())
    ok(result)
    assert re.search(rf"^would \w+ {count} ", result.stdout), result
    assert _everything(store) == before


def test_a_dry_run_of_dead_ids_counts_them(
    cli: Cli, target: Target, store: Store, seeded: Seeded
) -> None:
    before = _everything(store)
    ids = [str(seeded.dead_old), str(seeded.dead_new)]
    requeue = cli("dead", "requeue", *ids, "--dry-run", *target.cli_args())
    ok(requeue)
    assert requeue.stdout.strip() == "would requeue 2 dead letter(s)"
    purge = cli("dead", "purge", ids[0], "--dry-run", *target.cli_args())
    ok(purge)
    assert purge.stdout.strip() == "would purge 1 dead letter(s)"
    assert _everything(store) == before


@pytest.mark.parametrize(("command", "name", "count"), DESTRUCTIVE)
def test_off_a_terminal_destructive_commands_need_yes(
    cli: Cli,
    target: Target,
    store: Store,
    seeded: Seeded,
    command: list[str],
    name: str,
    count: int,
) -> None:
    before = _everything(store)
    result = cli(*command, *target.cli_args())
    assert result.code == 2, result
    (line,) = result.stderr.strip().splitlines()
    assert f"`outboxkit {name}`" in line and "pass --yes" in line, result
    assert _everything(store) == before
    done = cli(*command, "--yes", *target.cli_args())
    ok(done)
    assert re.search(rf"^\w+ {count} ", done.stdout), done
    assert _everything(store) != before


def test_dead_purge_by_id_needs_yes_too(
    cli: Cli, target: Target, store: Store, seeded: Seeded
) -> None:
    result = cli("dead", "purge", str(seeded.dead_new), *target.cli_args())
    assert result.code == 2, result
    assert "pass --yes" in result.stderr, result
    assert store.get(seeded.dead_new) is not None


@pytest.mark.parametrize(("answer", "purged"), [("n", False), ("y", True)])
def test_on_a_terminal_purge_asks_first(
    process_cli: Cli, target: Target, store: Store, seeded: Seeded, answer: str, purged: bool
) -> None:
    from .conftest import TIMEOUT, outboxkit_command

    parent, child = pty.openpty()
    try:
        proc = subprocess.Popen(
            [*outboxkit_command(), "purge", "--published-older-than", "7d", *target.cli_args()],
            cwd=process_cli.cwd,
            env=process_cli.env(),
            stdin=child,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        os.write(parent, f"{answer}\n".encode())
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    finally:
        os.close(parent)
        os.close(child)
    assert proc.returncode == 0, (stdout, stderr)
    assert "delete 2 published event(s) older than 7d? [y/N]" in stdout, stdout
    gone = [store.get(i) is None for i in seeded.published_old]
    assert gone == [purged, purged]
    assert stdout.strip().endswith(
        "purged 2 published event(s) older than 7d" if purged else "nothing purged"
    )


def test_migrate_says_it_upgraded_an_older_sqlite_schema(cli: Cli, tmp_path: Path) -> None:
    from outboxkit_sqlite import schema
    from outboxkit_sqlite.tables import TableNames

    path = tmp_path / "old.db"
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("BEGIN IMMEDIATE")
        schema.migrate(conn, TableNames(), applied_at=0, where=str(path), target=2)
        conn.execute("COMMIT")
    status = cli("status", "--json", "--store", f"sqlite:///{path}")
    ok(status)  # read as it is: status does not upgrade it
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT max(version) FROM outbox_schema").fetchone() == (2,)
    result = cli("migrate", "--store", f"sqlite:///{path}")
    ok(result)
    assert result.stdout.startswith(f"upgraded 2 -> {schema.SCHEMA_VERSION}: "), result
