"""How a failing command ends: one line on stderr, never a traceback.

Wrong input (an APP that does not import, an attribute that is not an ``Outbox``, an unknown
store scheme, a bad duration, an id that is not a dead letter, a database that refuses the
connection or its credentials: ``CannotConnect``) exits with :data:`WRONG_INPUT`; another store
failure (the schema is missing, the database failed during the command) with :data:`FAILURE`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import click

from ..errors import CannotConnect, ConfigurationError, OutboxError
from .output import fail

__all__ = ["FAILURE", "WRONG_INPUT", "InputError", "OneLineErrors"]

WRONG_INPUT = 2
"""The exit code of wrong input, the same as click's usage errors."""
FAILURE = 1
"""The exit code of a failure that is not the input's fault."""


class InputError(click.ClickException):
    """Wrong input that is not a usage error as click sees it (an id that is not a dead letter,
    an APP that does not import): exit code 2, like a usage error."""

    exit_code = WRONG_INPUT


class OneLineErrors(click.Group):
    """A group whose errors are one line on stderr (click's own print a usage block)."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            result = super().main(args, prog_name, complete_var, False, **extra)
        except click.exceptions.Abort:
            fail("aborted", FAILURE)
        except click.ClickException as exc:
            fail(exc.format_message(), exc.exit_code)
        except (ConfigurationError, CannotConnect) as exc:
            fail(str(exc), WRONG_INPUT)
        except OutboxError as exc:
            fail(str(exc), FAILURE)
        sys.exit(result if isinstance(result, int) else 0)
