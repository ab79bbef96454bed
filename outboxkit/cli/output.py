"""Everything the command prints goes through :func:`echo`.

Stored text (topics, keys, headers, payloads, rejection reasons, error texts) is whatever an
app and its handlers put there, escape sequences included: ``echo`` shows every control
character as an escape, so none reaches a terminal or a pipe. Tables and JSON are built here
and printed through it too.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import NoReturn

import click

from ..core.text import printable, printable_json

__all__ = ["age", "clip", "echo", "fail", "one_line", "print_json", "table"]


def echo(text: str = "", *, err: bool = False) -> None:
    """Print ``text`` and a newline, every control character but the line breaks escaped.

    Args:
        text: one line or several.
        err: to stderr instead of stdout.
    """
    click.echo(printable(text, newlines=True), err=err)


def one_line(text: str) -> str:
    """``text`` on one line (runs of blanks and line breaks become one space), escaped."""
    return printable(" ".join(str(text).split()))


def clip(text: str, width: int) -> str:
    """``text`` on one line, cut to ``width`` characters with an ellipsis."""
    text = one_line(text)
    return text if len(text) <= width else text[: width - 1] + "…"


def fail(message: str, code: int) -> NoReturn:
    """Print ``Error: message`` on one line to stderr and exit with ``code``."""
    echo(f"Error: {one_line(message)}", err=True)
    sys.exit(code)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """``rows`` under ``headers`` in aligned columns; integer columns are right-aligned.

    Args:
        headers: the column titles.
        rows: the cells, one sequence per row; None is an empty cell.

    Returns:
        The lines of the table (cells escaped), without a trailing newline.
    """
    cells = [
        [str(h) for h in headers],
        *[["" if c is None else printable(c) for c in r] for r in rows],
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [all(isinstance(r[i], int) for r in rows) and bool(rows) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [
            cell.rjust(widths[i]) if numeric[i] else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def print_json(data: object) -> None:
    """Print ``data`` as indented JSON; control characters in its strings are ``\\uXXXX``
    escapes, so the JSON shows safely and decodes to the exact stored text."""
    echo(printable_json(data))


def age(seconds: float | None) -> str:
    """A number of seconds in the largest unit that is at least one (``1.5h``), or ``-``."""
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.1f}s"
