"""The ``outboxkit`` click group, built from the commands of the package's modules."""

from __future__ import annotations

import click

from .. import __version__
from .conformance import conformance_command
from .demo.command import demo_command
from .doctor import doctor
from .errors import OneLineErrors
from .ops import dead, migrate, purge, status
from .runner import run_command
from .web import web_command

__all__ = ["cli"]


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="outboxkit")
def cli() -> None:
    """outboxkit: a transactional outbox for Python.

    Ops commands find the store with --store URL (or OUTBOXKIT_STORE), or --app
    module:attribute naming your Outbox. Durations: 30d, 12h, 15m, 10s, 500ms.
    """


for _command in (
    run_command,
    migrate,
    status,
    dead,
    purge,
    doctor,
    web_command,
    demo_command,
    conformance_command,
):
    cli.add_command(_command)
