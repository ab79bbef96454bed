"""The ``outboxkit`` command: run pollers, operate a store, try the demo, check a store.

The group is built here from the commands of its modules, each with one role:

- ``runner``: ``run``, pollers in this process or N supervised poller processes;
- ``ops``: ``migrate``, ``status``, ``dead list|show|requeue|purge``, ``purge`` (the same
  ``Outbox`` methods an app calls in Python);
- ``demo``: ``demo``, the example shop;
- ``conformance``: ``conformance``, the store conformance suite;
- ``stores``: the outbox a command works on (``--app``, ``--store``, ``OUTBOXKIT_STORE``);
- ``apps``: the one loader of ``module:attribute`` specs;
- ``params``: durations, instants and ``KEY=VALUE`` store options;
- ``output``: ``echo``, which every printed line goes through, tables and JSON;
- ``errors``: exit codes, and every error as one line on stderr.

Errors are one line on stderr, never a traceback: wrong input (an APP that does not import, an
attribute that is not an ``Outbox``, an unknown store scheme, a bad duration, an id that is not a
dead letter) exits with 2; a store failure (the database is down, the schema is missing) with 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import click

from .. import __version__
from .conformance import conformance_command
from .demo.command import demo_command
from .errors import OneLineErrors
from .ops import dead, migrate, purge, status
from .params import parse_duration
from .runner import run_command
from .stores import STORE_ENV, STORE_OPTIONS_ENV, load_app

__all__ = ["STORE_ENV", "STORE_OPTIONS_ENV", "cli", "load_app", "main", "parse_duration"]


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="outboxkit")
def cli() -> None:
    """outboxkit: a transactional outbox for Python.

    Ops commands find the store with --store URL (or OUTBOXKIT_STORE), or --app
    module:attribute naming your Outbox. Durations: 30d, 12h, 15m, 10s, 500ms.
    """


for _command in (run_command, migrate, status, dead, purge, demo_command, conformance_command):
    cli.add_command(_command)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``outboxkit`` console script and of ``python -m outboxkit``.

    Args:
        argv: the arguments after the command's name; None reads ``sys.argv``.
    """
    cli.main(args=list(argv) if argv is not None else None, prog_name="outboxkit")
