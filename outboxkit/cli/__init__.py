"""The ``outboxkit`` command: run pollers, operate a store, try the demo, check a store.

The group (``group``) is built from the commands of its modules, each with one role:

- ``runner``: ``run``, pollers in this process or N supervised poller processes;
- ``ops``: ``migrate``, ``status``, ``dead list|show|requeue|purge``, ``purge`` (the same
  ``Outbox`` methods an app calls in Python);
- ``doctor``: ``doctor``, the store's and its server's findings, each with its fix;
- ``web``: ``web``, the dashboard (``outboxkit.contrib.web``);
- ``demo``: ``demo``, the example shop;
- ``conformance``: ``conformance``, the store conformance suite;
- ``stores``: the outbox a command works on (``--app``, ``--store``, ``OUTBOXKIT_STORE``);
- ``apps``: the one loader of ``module:attribute`` specs;
- ``params``: durations, instants and ``KEY=VALUE`` store options;
- ``output``: ``echo``, which every printed line goes through, tables and JSON;
- ``logs`` and ``progress``: ``run``'s log (one format, the drivers' too) and drain progress;
- ``errors``: exit codes, and every error as one line on stderr.

Errors are one line on stderr, never a traceback: wrong input (an APP that does not import, an
attribute that is not an ``Outbox``, an unknown store scheme, a bad duration, an id that is not a
dead letter, a database that refuses the connection or its credentials) exits with 2; another
store failure (the schema is missing) with 1.

Importing the package loads none of them: ``main``, ``cli`` and the names below are looked up
when first used, so that ``outboxkit.cli.apps`` (the loader the pytest plugin and the
conformance suite use) costs no more than itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .group import cli
    from .params import parse_duration
    from .stores import STORE_ENV, STORE_OPTIONS_ENV, load_app

__all__ = ["STORE_ENV", "STORE_OPTIONS_ENV", "cli", "load_app", "main", "parse_duration"]


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``outboxkit`` console script and of ``python -m outboxkit``.

    Args:
        argv: the arguments after the command's name; None reads ``sys.argv``.
    """
    from .group import cli

    cli.main(args=list(argv) if argv is not None else None, prog_name="outboxkit")


def __getattr__(name: str) -> Any:
    if name == "cli":
        from .group import cli

        return cli
    if name == "parse_duration":
        from .params import parse_duration

        return parse_duration
    if name in ("STORE_ENV", "STORE_OPTIONS_ENV", "load_app"):
        from . import stores

        return getattr(stores, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
