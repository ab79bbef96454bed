"""Numbers too large for a float, a timedelta, a database integer or datetime arithmetic
: every command either does the sensible thing (a cutoff of a million days
selects nothing) or refuses in one line with exit code 2; never a traceback.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from outboxkit import ConfigurationError, MemoryStore, Outbox
from tests.backends import Target

from .apps import App
from .conftest import Cli

HUGE = "99999999999999999999"

REFUSED = [
    pytest.param(["dead", "list", "--limit", HUGE], "limit", id="dead-list-limit"),
    pytest.param(["dead", "show", HUGE], f"'{HUGE}' is not an event id", id="dead-show-id"),
    pytest.param(["dead", "requeue", HUGE], f"'{HUGE}' is not an event id", id="requeue-id"),
    pytest.param(["dead", "purge", HUGE, "--yes"], f"'{HUGE}' is not an event id", id="purge-id"),
]
RUN_REFUSED = [
    pytest.param(["--lease", "9999999d"], "lease must be at most 3660 days", id="lease"),
    pytest.param(["--interval", "9999999d"], "interval must be at most 3660 days", id="interval"),
    pytest.param(["--batch-size", HUGE + "00"], "batch_size", id="batch-size"),
    pytest.param(["--max-retries", HUGE], "max_retries", id="max-retries"),
]
HANDLED = [
    pytest.param(["purge", "--published-older-than", "999999d", "--yes"], "purged 0", id="purge"),
    pytest.param(["dead", "list", "--since", "999999d"], "no dead letters", id="dead-list-since"),
    pytest.param(
        ["dead", "purge", "--older-than", "999999d", "--yes"], "purged 0", id="dead-purge"
    ),
]


def _one_line_error(result: object, expected: str) -> None:
    code, stderr = result.code, result.stderr  # type: ignore[attr-defined]
    assert code == 2, result
    assert stderr.startswith("Error: ") and stderr.count("\n") == 1, result
    assert expected in stderr, result
    assert "Traceback" not in stderr


@pytest.mark.parametrize(("args", "expected"), REFUSED)
def test_huge_numbers_are_refused_in_one_line(
    cli: Cli, target: Target, store: object, args: list[str], expected: str
) -> None:
    _one_line_error(cli(*args, *target.cli_args()), expected)


@pytest.mark.parametrize(("args", "expected"), RUN_REFUSED)
def test_huge_run_options_are_refused_in_one_line(
    cli: Cli, target: Target, app: App, args: list[str], expected: str
) -> None:
    _one_line_error(cli("run", app.spec(), "--until-idle", *args), expected)


@pytest.mark.parametrize(("args", "expected"), HANDLED)
def test_huge_cutoffs_select_nothing(
    cli: Cli, target: Target, store: object, args: list[str], expected: str
) -> None:
    result = cli(*args, *target.cli_args())
    assert result.code == 0, result
    assert expected in result.stdout
    assert "Traceback" not in result.stderr


def test_a_retention_of_3000_years_is_refused_at_construction() -> None:
    with pytest.raises(ConfigurationError, match="retain_published must be at most 3660 days"):
        Outbox(MemoryStore(), retain_published=timedelta(days=3000 * 365))
