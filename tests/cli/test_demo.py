"""``outboxkit demo``: the shop on a SQLite file, its summary, and the commands it points to."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from outboxkit import Outcome, open_store

from .conftest import Cli, Result

EXAMPLE_README = Path(__file__).resolve().parents[2] / "examples" / "shop" / "README.md"


def ok(result: Result) -> None:
    assert result.code == 0, result
    assert "Traceback" not in result.stdout + result.stderr, result


def summary_rows(stdout: str) -> dict[str, list[int]]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("HANDLER"))
    assert lines[start].split() == ["HANDLER", "PUBLISHED", "REJECTED", "RETRIED", "DEAD-LETTERED"]
    rows = {}
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        name, *numbers = line.split()
        rows[name] = [int(n) for n in numbers]
    return rows


@pytest.fixture
def demo_cli(tmp_path: Path, request: pytest.FixtureRequest) -> Cli:
    work = tmp_path / "cwd"
    work.mkdir()
    return Cli(request.param, work)


@pytest.mark.parametrize("demo_cli", ["runner", "process"], indirect=True)
def test_demo_runs_the_shop_and_says_where_to_look(demo_cli: Cli, tmp_path: Path) -> None:
    db = tmp_path / "data" / "demo.db"
    db.parent.mkdir()
    result = demo_cli("demo", "--db", str(db), "--orders", "120")
    ok(result)
    rows = summary_rows(result.stdout)
    assert set(rows) == {"fraud-check", "reserve-stock", "send-receipt"}
    for name, (published, rejected, _, dead) in rows.items():
        assert published + rejected + dead == 120, (name, result)
    assert rows["fraud-check"][1] > 0  # some orders are over the fraud limit
    assert rows["send-receipt"][2] > 0  # the flaky mail server made it retry
    assert rows["send-receipt"][1] == 0  # a mail is retried, never rejected

    # The table agrees with the database.
    store = open_store(f"sqlite:///{db.as_posix()}")
    try:
        stats = store.stats(now=None)
        (line,) = [x for x in result.stdout.splitlines() if x.startswith("120 orders:")]
        published, dead = map(int, re.findall(r"(\d+) events published, (\d+) dead", line)[0])
        assert (stats.published, stats.dead, stats.pending) == (published, dead, 0)
        assert published + dead == 120
        succeeded = {name: 0 for name in rows}
        for event in store.events(limit=1000):
            for record in store.records(event.id):
                if record.outcome is Outcome.SUCCEEDED:
                    succeeded[record.handler] += 1
        assert succeeded == {name: row[0] for name, row in rows.items()}
        assert rows["send-receipt"][3] == dead
    finally:
        store.close()

    # "Where to look next" names commands that work as printed.
    hints = [x.strip() for x in result.stdout.splitlines() if x.strip().startswith("outboxkit ")]
    status = next(h for h in hints if h.startswith("outboxkit status"))
    dead_list = next(h for h in hints if h.startswith("outboxkit dead list"))
    as_json = demo_cli(*shlex.split(status)[1:], "--json")
    ok(as_json)
    assert json.loads(as_json.stdout)["published"] == published
    listed = demo_cli(*shlex.split(dead_list)[1:], "--json")
    ok(listed)
    assert len(json.loads(listed.stdout)) == dead


def test_demo_writes_to_the_working_directory_by_default(tmp_path: Path) -> None:
    cli = Cli("runner", tmp_path)
    first = cli("demo", "--orders", "20")
    ok(first)
    assert (tmp_path / "outboxkit-demo.db").is_file()
    # The example's README shows the hints as the demo prints them for this default file.
    hints = first.stdout.split("where to look next:\n", 1)[1].splitlines()
    readme = EXAMPLE_README.read_text(encoding="utf-8").splitlines()
    assert len(hints) == 5
    for hint in hints:
        assert hint.strip() in readme, hint
    # A second run reuses the file and counts only its own orders.
    again = cli("demo", "--orders", "20")
    ok(again)
    assert "20 orders:" in again.stdout
    store = open_store(f"sqlite:///{(tmp_path / 'outboxkit-demo.db').as_posix()}")
    try:
        assert store.stats(now=None).total == 40
    finally:
        store.close()


def test_the_shop_app_delivers_the_requeued_dead_letters(tmp_path: Path) -> None:
    """The demo's last hints: requeue the dead letters, then run the shop's own poller (whose
    mail server works) until idle."""
    cli = Cli("process", tmp_path)
    demo = cli("demo", "--orders", "150")
    ok(demo)
    url = "sqlite:///outboxkit-demo.db"
    requeued = cli("dead", "requeue", "--all", "--yes", "--store", url)
    ok(requeued)
    assert int(requeued.stdout.split()[1]) > 0  # the demo dead-letters a few receipts
    (hint,) = [x.strip() for x in demo.stdout.splitlines() if " outboxkit run " in x]
    env_part, command = hint.split(" outboxkit ", 1)
    env = dict(item.split("=", 1) for item in shlex.split(env_part))
    ok(cli(*shlex.split(command), env=env))
    store = open_store(f"sqlite:///{(tmp_path / 'outboxkit-demo.db').as_posix()}")
    try:
        stats = store.stats(now=None)
        assert (stats.published, stats.dead, stats.pending) == (150, 0, 0)
    finally:
        store.close()
