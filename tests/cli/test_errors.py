"""Wrong input: each is one line on stderr, exit code 2, and never a traceback (CliRunner and a
real subprocess; the store-bound cases on SQLite and PostgreSQL)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from outboxkit import Store
from tests.backends import Target

from .apps import App, Seeded, seed, write_app
from .conftest import Cli, Result


def assert_wrong_input(result: Result, *fragments: str) -> None:
    assert result.code == 2, result
    assert "Traceback" not in result.stdout + result.stderr, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result
    assert lines[0].startswith("Error: "), result
    for fragment in fragments:
        assert fragment in lines[0], result


Args = Callable[[App], list[str]]
MEM = ["--store", "memory://"]  # a store for the cases that fail before reaching one

CASES: list[tuple[str, Args, tuple[str, ...]]] = [
    # An APP that does not import, is malformed, or is not an Outbox.
    ("app-missing-module", lambda a: ["run", "no_such_module_xyz:outbox"], ("cannot import",)),
    ("app-without-colon", lambda a: ["run", a.name], ("module:attribute",)),
    ("app-missing-attribute", lambda a: ["run", a.spec("nope")], ("no attribute 'nope'",)),
    ("app-not-an-outbox", lambda a: ["run", a.spec("not_an_outbox")], ("not an outboxkit.Outbox",)),
    ("ops-app-not-an-outbox", lambda a: ["status", "--app", a.spec("bus")], ("EventBus",)),
    # An unknown store scheme, for run and for the ops commands, by flag or environment.
    ("run-unknown-scheme", lambda a: ["run", a.spec(), "--store", "nosuch://x"], ("nosuch://",)),
    ("ops-unknown-scheme", lambda a: ["status", "--store", "nosuch://x"], ("nosuch://",)),
    ("env-unknown-scheme", lambda a: ["dead", "list"], ("nosuch://",)),  # OUTBOXKIT_STORE
    ("not-a-url", lambda a: ["status", "--store", "app.db"], ("scheme://",)),
    ("bad-store-option", lambda a: ["status", *MEM, "-o", "x=1"], ("options",)),
    ("store-option-syntax", lambda a: ["status", *MEM, "-o", "x"], ("KEY=VALUE",)),
    ("no-store", lambda a: ["status"], ("no store",)),
    ("missing-dir", lambda a: ["status", "--store", "sqlite:///no/dir/x.db"], ("does not exist",)),
    # A bad duration, wherever one is taken.
    ("purge-duration", lambda a: ["purge", "--published-older-than", "7x", *MEM], ("7x",)),
    ("dead-purge-duration", lambda a: ["dead", "purge", "--older-than", "-5d", *MEM], ("-5d",)),
    ("run-lease-duration", lambda a: ["run", a.spec(), "--lease", "soon"], ("soon",)),
    ("run-grace-duration", lambda a: ["run", a.spec(), "--grace", "1 fortnight"], ("fortnight",)),
    ("run-zero-interval", lambda a: ["run", a.spec(), "--interval", "0"], ("interval",)),
    ("since", lambda a: ["dead", "list", "--since", "yesterday", *MEM], ("yesterday",)),
    # Bad numbers and combinations.
    ("batch-size", lambda a: ["run", a.spec(), "--batch-size", "0"], ("--batch-size",)),
    ("processes", lambda a: ["run", a.spec(), "--processes", "many"], ("--processes",)),
    ("id-not-a-number", lambda a: ["dead", "show", "seven", *MEM], ("seven",)),
    ("requeue-ids-and-all", lambda a: ["dead", "requeue", "1", "--all", *MEM], ("--all",)),
    ("requeue-nothing", lambda a: ["dead", "requeue", *MEM], ("--all",)),
    ("topic-without-all", lambda a: ["dead", "requeue", "1", "--topic", "t", *MEM], ("--topic",)),
    ("purge-nothing", lambda a: ["dead", "purge", *MEM], ("--older-than",)),
    ("purge-published-missing", lambda a: ["purge", *MEM], ("--published-older-than",)),
    ("unknown-option", lambda a: ["status", "--colour", *MEM], ("--colour",)),
    ("demo-orders", lambda a: ["demo", "--orders", "0"], ("--orders",)),
    ("demo-directory", lambda a: ["demo", "--db", "no/such/dir/demo.db"], ("does not exist",)),
]


@pytest.fixture
def memory_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[App]:
    """A test app whose own store is an in-memory one (these cases never reach a store)."""
    written = write_app(tmp_path / "app")
    monkeypatch.setenv("CLI_TEST_STORE", "memory://")
    monkeypatch.setenv("CLI_TEST_STORE_OPTIONS", "{}")
    monkeypatch.syspath_prepend(str(written.folder))
    yield written
    sys.modules.pop(written.name, None)


@pytest.mark.parametrize(("args", "fragments"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_wrong_input_is_one_line_and_exit_2(
    cli: Cli, memory_app: App, args: Args, fragments: tuple[str, ...]
) -> None:
    argv = args(memory_app)
    env = {"OUTBOXKIT_STORE": "nosuch://x"} if argv == ["dead", "list"] else None
    assert_wrong_input(cli(*argv, env=env), *fragments)


@pytest.fixture
def seeded(store: Store, app: App) -> Seeded:
    return seed(store, app.bus)


@pytest.mark.parametrize(
    "command",
    [
        ["dead", "show"],
        ["dead", "requeue"],
        ["dead", "purge", "--yes"],
    ],
)
def test_an_id_that_is_not_a_dead_letter(
    cli: Cli, target: Target, store: Store, seeded: Seeded, command: list[str]
) -> None:
    missing = cli(*command, "999999", *target.cli_args())
    assert_wrong_input(missing, "999999")
    published = seeded.published_new[0]
    not_dead = cli(*command, str(published), *target.cli_args())
    assert_wrong_input(not_dead, str(published), "published")
    # With one bad id among good ones nothing is done at all.
    mixed = cli(*command, str(seeded.dead_old), "999999", *target.cli_args())
    assert_wrong_input(mixed, "999999")
    assert [d.event.id for d in store.dead_letters()] == [seeded.dead_old, seeded.dead_new]


def test_a_file_that_is_not_a_database(cli: Cli, tmp_path: Path) -> None:
    bogus = tmp_path / "cwd" / "notes.db"
    bogus.write_text("this is not a database\n" * 100)
    result = cli("status", "--store", f"sqlite:///{bogus.as_posix()}")
    assert_wrong_input(result, "not a database")


@pytest.mark.parametrize("command", ["run", "status"])
def test_run_refuses_a_sqlite_database_that_does_not_exist_as_status_does(
    cli: Cli, memory_app: App, tmp_path: Path, command: str
) -> None:
    typo = tmp_path / "cwd" / "typo.db"
    url = f"sqlite:///{typo.as_posix()}"
    argv = ["run", memory_app.spec(), "--store", url] if command == "run" else ["status"]
    result = cli(*argv, *(["--store", url] if command == "status" else []))
    assert_wrong_input(result, "there is no SQLite database", "outboxkit migrate")
    assert not typo.exists()  # nothing created, no tables, no poller idling there
