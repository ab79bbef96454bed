"""The ``outboxkit`` command."""

from __future__ import annotations

import sys

from . import __version__


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``outboxkit`` console script."""
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("--version", "-V"):
        print(f"outboxkit {__version__}")
        return 0
    print("usage: outboxkit --version", file=sys.stderr)
    return 2
