"""The documentation's pages as the tests read them: every code block of the README and of the
site under ``docs/`` runs in a test of the page it is on (``tests/unit/test_docs.py`` checks
that each page with code is claimed by one)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def page(name: str) -> str:
    """The text of a page: ``"README.md"``, or a path under ``docs/`` (``"how-to/asyncio.md"``)."""
    path = ROOT / name if name == "README.md" else DOCS / name
    return path.read_text(encoding="utf-8")


def blocks(text: str, language: str) -> list[str]:
    """The fenced code blocks of ``language`` in ``text``, at any indentation, dedented."""
    found: list[str] = []
    for indent, body in re.findall(
        rf"^([ \t]*)```{language}\n(.*?)^\1```", text, flags=re.S | re.M
    ):
        lines = body.splitlines(keepends=True)
        found.append("".join(line[len(indent) :] for line in lines))
    return found


def python_blocks(text: str) -> list[str]:
    return blocks(text, "python")
