"""The loader of a store's ``queries.sql``: blocks introduced by ``-- name: <name>``.

Comment lines (starting with two dashes) are dropped, so they may say anything. What a store
does with a block's text - fill its identifier slots (``{events}``...) with quoted names, never
values - is its own; values stay parameters, bound at execution.
"""

from __future__ import annotations

import functools
import re
from importlib import resources

__all__ = ["load_queries"]

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
