"""Durations as the command reads and writes them (``outboxkit.cli.params``)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outboxkit import ConfigurationError
from outboxkit.cli import parse_duration
from outboxkit.cli.params import format_duration
from outboxkit.core.duration import MAX_DURATION


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
