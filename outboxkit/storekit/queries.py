"""The loader of a store's ``queries.sql``: blocks introduced by ``-- name: <name>``.

Comment lines (starting with two dashes) are dropped, so they may say anything. What a store
does with a block's text - fill its identifier slots (``{events}``...) with quoted names, never
values - is its own; values stay parameters, bound at execution.

A database without ``UPDATE ... RETURNING`` (MariaDB, MySQL) writes a statement of the seam
as a block of steps, each ending with ``;`` at the end of a line, run by ``run_steps``: a
step that returns rows (a ``SELECT ... FOR UPDATE`` picking the rows to change) binds their
first column as the parameter ``picked`` of the steps after it, and the block returns the
rows of its last step that returned some.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from typing import Any

__all__ = ["load_queries", "run_steps", "split_steps"]

_NAME = re.compile(r"^-- name: ([a-z_0-9]+)\s*$")


@functools.cache
def load_queries(package: str, resource: str = "queries.sql") -> dict[str, str]:
    """The statements of ``package``'s ``resource`` file by name, comment lines removed.

    Raises:
        RuntimeError: a name is defined twice (a mistake in the file, found at import).
    """
    text = resources.files(package).joinpath(resource).read_text("utf-8")
    blocks: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        match = _NAME.match(line)
        if match:
            name = match.group(1)
            if name in blocks:
                raise RuntimeError(f"{package}/{resource}: {name!r} is defined twice")
            current = blocks[name] = []
        elif current is not None and not line.lstrip().startswith("--"):
            current.append(line)
    return {name: "\n".join(lines).strip() for name, lines in blocks.items()}


def split_steps(block: str) -> list[str]:
    """The steps of a block: its statements, each ended by ``;`` at the end of a line (the
    last one needs none)."""
    steps = re.split(r";[ \t]*(?:\n|$)", block)
    return [step.strip() for step in steps if step.strip()]


def run_steps(
    execute: Callable[[str, Mapping[str, Any]], Sequence[Sequence[Any]] | None],
    steps: Sequence[str],
    params: Mapping[str, Any],
) -> list[Sequence[Any]]:
    """Run ``steps`` (``split_steps``) in order through ``execute(sql, params)``, which returns
    a statement's rows, or None for one that returns none (an UPDATE, a DELETE).

    A step's rows bind their first column, as a tuple, as the parameter ``picked`` of the
    steps after it; a step that returns no row ends the block (there is nothing left to act
    on). Returns the rows of the last step that returned rows ([] if none did).
    """
    bound = dict(params)
    rows: list[Sequence[Any]] = []
    for step in steps:
        got = execute(step, bound)
        if got is None:
            continue
        rows = list(got)
        if not rows:
            return []
        bound["picked"] = tuple(row[0] for row in rows)
    return rows
