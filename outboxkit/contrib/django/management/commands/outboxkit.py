"""``python manage.py outboxkit run|status|dead|purge|migrate|web ...``: the ``outboxkit`` command's
own commands, on the outbox ``settings.OUTBOXKIT["OUTBOX"]`` names (its store on Django's
connection). Options are the ``outboxkit`` command's: ``manage.py outboxkit run --help``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from outboxkit.errors import ConfigurationError

COMMANDS = ("run", "status", "dead", "purge", "migrate", "web", "doctor")


def outboxkit_argv(args: list[str], app: str) -> list[str]:
    """``args`` (after ``manage.py outboxkit``) as the ``outboxkit`` command's, with the app.

    Raises:
        CommandError: no command, an unknown one, or ``run --processes`` above 1.
    """
    if not args or args[0] in ("-h", "--help"):
        return ["--help"]
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        raise CommandError(
            f"unknown outboxkit command {command!r}; the commands are {', '.join(COMMANDS)}"
        )
    if command == "run":
        for i, arg in enumerate(rest):
            value = rest[i + 1] if arg == "--processes" and i + 1 < len(rest) else None
            if arg.startswith("--processes="):
                value = arg.partition("=")[2]
            if value is not None and value != "1":
                raise CommandError(
                    "manage.py outboxkit run runs one poller process: start several "
                    "`manage.py outboxkit run` processes (a process manager's job) instead of "
                    "--processes"
                )
        return ["run", app, *rest]
    if command == "dead":
        if not rest or rest[0].startswith("-"):
            return ["dead", *rest]
        return ["dead", rest[0], "--app", app, *rest[1:]]
    return [command, "--app", app, *rest]


class Command(BaseCommand):  # type: ignore[misc]  # Django has no type hints
    help = "outboxkit: run pollers and operate the outbox (run, status, dead, purge, migrate, web)."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("args", nargs=argparse.REMAINDER)

    def run_from_argv(self, argv: list[str]) -> None:
        # The outboxkit command parses its own options (and exits with its own codes). Django's
        # own run_from_argv, which this replaces, is what turns a CommandError into one line.
        try:
            self.execute_outboxkit(argv[2:])
        except CommandError as exc:
            self.stderr.write(f"CommandError: {exc}")
            sys.exit(exc.returncode)

    def handle(self, *args: str, **options: Any) -> None:
        self.execute_outboxkit(list(args))

    def execute_outboxkit(self, args: list[str]) -> None:
        from outboxkit.cli import main
        from outboxkit.contrib.django.conf import config
        from outboxkit.contrib.django.store import DjangoStore

        try:
            app = config().outbox
        except ConfigurationError as exc:
            raise CommandError(str(exc)) from None
        if app is None:
            raise CommandError(
                "settings.OUTBOXKIT['OUTBOX'] is not set: name the app's Outbox, e.g. "
                "OUTBOXKIT = {'OUTBOX': 'myapp.events:outbox'}"
            )
        argv = outboxkit_argv(args, app)
        if argv != ["--help"]:
            from outboxkit.cli.apps import LoadError, load_object
            from outboxkit.outbox import Outbox

            try:
                outbox: Outbox = load_object(app, what="settings.OUTBOXKIT['OUTBOX']", kind=Outbox)
            except LoadError as exc:
                raise CommandError(str(exc)) from None
            if not isinstance(outbox.store, DjangoStore) and "--store" not in args:
                raise CommandError(
                    f"{app}'s store is {outbox.store!r}, not Django's: build the outbox with "
                    "outboxkit.contrib.django.store() (Outbox(store(), bus))"
                )
        main(argv)
