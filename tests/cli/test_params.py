"""Durations and numbers as the command reads (and writes) them (``outboxkit.cli.params``)."""

from __future__ import annotations

from datetime import timedelta

import click
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from outboxkit import ConfigurationError
from outboxkit.cli import cli, parse_duration
from outboxkit.cli.params import EVENT_ID, Whole, format_duration
from outboxkit.core.duration import MAX_DURATION
from outboxkit.core.text import parse_decimal


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30d", timedelta(days=30)),
        ("12h", timedelta(hours=12)),
        ("15m", timedelta(minutes=15)),
        ("10s", timedelta(seconds=10)),
        ("500ms", timedelta(milliseconds=500)),
        ("2w", timedelta(weeks=2)),
        ("1.5", timedelta(seconds=1.5)),
        (".5s", timedelta(milliseconds=500)),
        (" 7D ", timedelta(days=7)),
        ("0", timedelta(0)),
    ],
)
def test_parse_duration(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize(
    "text", ["7x", "-5d", "soon", "", "1 fortnight", "1e3s", "5 s", "9" * 400 + "d", None]
)
def test_what_is_not_a_duration_is_a_configuration_error(text: str) -> None:
    with pytest.raises(ConfigurationError, match="duration") as caught:
        parse_duration(text)
    assert isinstance(caught.value, ValueError)  # as every ConfigurationError is
    assert repr(text)[:20] in str(caught.value)


@pytest.mark.parametrize(
    ("delta", "text"),
    [
        (timedelta(0), "0s"),
        (timedelta(days=7), "7d"),
        (timedelta(hours=36), "36h"),
        (timedelta(seconds=90), "90s"),
        (timedelta(milliseconds=500), "500ms"),
        (timedelta(microseconds=250), "0.250ms"),
    ],
)
def test_format_duration_uses_the_largest_exact_unit(delta: timedelta, text: str) -> None:
    assert format_duration(delta) == text


@given(st.timedeltas(min_value=timedelta(0), max_value=MAX_DURATION))
def test_format_duration_reads_back(delta: timedelta) -> None:
    assert parse_duration(format_duration(delta)) == delta


# -- numbers: ASCII digits only (bug 11's sibling on the command line) ---------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("7", 7),
        ("007", 7),
        ("9223372036854775807", 2**63 - 1),
        ("9223372036854775808", None),  # past the bound
        ("0", None),  # below the minimum
        ("²", None),  # a digit to str.isdigit, refused by int
        ("\u0661\u0662", None),  # 12 to int (Arabic-Indic digits)
        ("\uff11\uff12", None),  # 12 to int (fullwidth digits)
        (" 12", None),
        ("1_2", None),
        ("+1", None),
        ("-1", None),
        ("", None),
        ("9" * 5000, None),  # past int()'s 4,300 digits
    ],
)
def test_parse_decimal_takes_ascii_digits_only(text: str, expected: int | None) -> None:
    assert parse_decimal(text, minimum=1, maximum=2**63 - 1) == expected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["dead", "show", "²"], "'²' is not an event id"),
        (["dead", "show", "\u0661\u0662"], "'\u0661\u0662' is not an event id"),
        (["dead", "show", "9223372036854775808"], "is not an event id"),
        (["dead", "requeue", "1", "1_2"], "'1_2' is not an event id"),
        (["dead", "purge", "0"], "'0' is not an event id"),
        (["dead", "list", "--limit", "\u0661\u0660"], "'\u0661\u0660' is not a whole number"),
        (["web", "--port", "\uff18\uff10"], "'\uff18\uff10' is not a whole number"),
        (["run", "x:y", "--batch-size", "1_0"], "'1_0' is not a whole number"),
        (["run", "x:y", "--processes", "0"], "0 is not in the range x>=1"),
    ],
)
def test_command_line_numbers_are_ascii_digits(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, [*args, "--store", "memory://"], prog_name="outboxkit")
    assert result.exit_code == 2, result.output
    assert message in result.stderr, result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_command_line_whole_numbers_and_ids_still_read_plain_digits() -> None:
    assert Whole(1, 10).convert("007", None, None) == 7
    assert EVENT_ID.convert("42", None, None) == 42
    with pytest.raises(click.BadParameter, match="not in the range"):
        Whole(1, 10).convert("11", None, None)
