"""The ``demo`` command: the example shop on a SQLite file, what happened per handler, and the
commands to look further."""

from __future__ import annotations

import logging
import shlex
import sys
from pathlib import Path

import click

from ..errors import InputError
from ..output import echo, table
from ..params import Whole

__all__ = ["APP", "demo_command"]

APP = "outboxkit.cli.demo.app:outbox"
"""The shop's outbox as an app module, for ``outboxkit run`` (see ``app``)."""


@click.command("demo", short_help="Run the example shop on a SQLite file and show what happened.")
@click.option(
    "--db",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The SQLite file (default: outboxkit-demo.db in the current directory).",
)
@click.option(
    "--orders", type=Whole(min=1), default=300, show_default=True, help="Orders to place."
)
def demo_command(db: Path | None, orders: int) -> None:
    """Place orders in the example shop (outboxkit.cli.demo), deliver them to its three handlers
    (fraud-check rejects big orders, reserve-stock writes the stock table, send-receipt calls a
    flaky mail server that is retried), and print what happened, per handler."""
    # Imported here: the shop (its bus, its handlers) is this command's alone.
    from .runner import DEFAULT_DB, main

    path = db if db is not None else Path(DEFAULT_DB)
    if not path.parent.is_dir():
        raise InputError(f"--db {str(path)!r}: the directory {str(path.parent)!r} does not exist")
    echo(f"placing {orders} orders in the shop on {path} ...")
    # The handlers' failures are the point of the demo: count them, do not print a traceback
    # for each (Python's last-resort handler would, with no logging configured).
    quiet = logging.NullHandler()
    logger = logging.getLogger("outboxkit")
    logger.addHandler(quiet)
    try:
        with click.progressbar(length=orders, label="delivering", file=sys.stderr) as bar:
            result = main(path, orders=orders, progress=bar.update)
    finally:
        logger.removeHandler(quiet)
    rows = [
        [name, t.published, t.rejected, t.retried, t.dead_lettered]
        for name, t in result.handlers.items()
    ]
    echo("")
    echo(table(["HANDLER", "PUBLISHED", "REJECTED", "RETRIED", "DEAD-LETTERED"], rows))
    echo("")
    echo(
        f"{result.orders} orders: {result.published} events published, "
        f"{result.dead_lettered} dead-lettered, {result.pending} pending, "
        f"in {result.seconds:.1f}s"
    )
    url = _demo_url(path)
    store = shlex.quote(url)
    echo("")
    echo("where to look next:")
    echo(f"  outboxkit status --store {store}")
    echo(f"  outboxkit dead list --store {store}")
    echo(f"  outboxkit dead show ID --store {store}")
    echo(f"  outboxkit dead requeue --all --store {store}")
    echo(
        f"  SHOP_DB={shlex.quote(url.removeprefix('sqlite:///'))} outboxkit run {APP} --until-idle"
    )


def _demo_url(path: Path) -> str:
    """The store URL to print: relative when the file is under the working directory."""
    resolved = path.resolve()
    try:
        shown = resolved.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        shown = resolved.as_posix()
    return f"sqlite:///{shown}"
