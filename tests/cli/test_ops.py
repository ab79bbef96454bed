"""``outboxkit migrate | status | dead ... | purge`` on SQLite and PostgreSQL, through click's
CliRunner and a real subprocess (every test runs four ways)."""

from __future__ import annotations

import json
import re
from datetime import timedelta

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


def test_migrate_creates_the_schema(cli: Cli, target: Target) -> None:
    if target.backend == "pg":
        before = cli("status", *target.cli_args())
        assert before.code == 1, before  # a store failure, not wrong input
        assert "migrate" in before.stderr
        assert len(before.stderr.strip().splitlines()) == 1, before
    result = cli("migrate", *target.cli_args())
    ok(result)
    assert "schema up to date" in result.stdout
    ok(cli("migrate", *target.cli_args()))  # idempotent
    after = cli("status", "--json", *target.cli_args())
    ok(after)
    assert json.loads(after.stdout)["total"] == 0


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
            if k not in ("now", "oldest_due_age_seconds")
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
    assert lines[0].split() == ["ID", "TOPIC", "ATTEMPTS", "FAILED", "AT", "LAST", "ERROR"]
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


def test_dead_requeue(cli: Cli, target: Target, store: Store, seeded: Seeded) -> None:
    result = cli("dead", "requeue", str(seeded.dead_old), *target.cli_args())
    ok(result)
    assert result.stdout.strip() == "requeued 1 dead letter(s)"
    event = store.get(seeded.dead_old)
    assert event is not None and event.state is State.PENDING and event.attempts == 0
    assert {r.handler for r in store.records(seeded.dead_old)} == {"reserve", "audit"}  # stay done

    none_left = cli("dead", "requeue", "--all", "--topic", "order.placed", *target.cli_args())
    assert none_left.stdout.strip() == "requeued 0 dead letter(s)"
    every = cli("dead", "requeue", "--all", *target.cli_args())
    ok(every)
    assert every.stdout.strip() == "requeued 1 dead letter(s)"
    assert store.stats(now=None).dead == 0


def test_dead_requeue_all_of_a_topic(
    cli: Cli, target: Target, store: Store, seeded: Seeded
) -> None:
    result = cli("dead", "requeue", "--all", "--topic", "invoice.due", *target.cli_args())
    ok(result)
    assert result.stdout.strip() == "requeued 1 dead letter(s)"
    assert [d.event.id for d in store.dead_letters()] == [seeded.dead_old]


def test_dead_purge(cli: Cli, target: Target, store: Store, seeded: Seeded) -> None:
    result = cli("dead", "purge", str(seeded.dead_new), *target.cli_args())
    ok(result)
    assert result.stdout.strip() == "purged 1 dead letter(s)"
    assert store.get(seeded.dead_new) is None

    old = cli("dead", "purge", "--older-than", "5d", *target.cli_args())
    ok(old)
    assert old.stdout.strip() == "purged 1 dead letter(s)"
    assert store.get(seeded.dead_old) is None
    assert store.records(seeded.dead_old) == []
    stats = store.stats(now=None)
    assert (stats.dead, stats.published, stats.pending) == (0, 3, 3)  # nothing else touched


def test_purge_published(cli: Cli, target: Target, store: Store, seeded: Seeded) -> None:
    result = cli("purge", "--published-older-than", "7d", *target.cli_args())
    ok(result)
    assert result.stdout.strip() == "purged 2 published event(s) older than 7d"
    for event_id in seeded.published_old:
        assert store.get(event_id) is None
        assert store.records(event_id) == []
    stats = store.stats(now=None)
    assert (stats.published, stats.dead, stats.pending) == (1, 2, 3)

    recent = cli("purge", "--published-older-than", "30m", *target.cli_args())
    assert recent.stdout.strip() == "purged 1 published event(s) older than 30m"
    stats = store.stats(now=None)
    assert (stats.published, stats.dead, stats.pending) == (0, 2, 3)  # dead and pending stay
