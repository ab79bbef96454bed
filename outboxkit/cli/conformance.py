"""``outboxkit conformance``: the store conformance suite (``outboxkit_conformance``) run by
pytest against a third party's store factory, with a one-line summary."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import click

from .output import echo

__all__ = ["conformance_command"]


@click.command(
    "conformance",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    short_help="Run the store conformance suite against a store factory.",
)
@click.argument("factory")
@click.argument("pytest_args", nargs=-1, type=click.UNPROCESSED)
def conformance_command(factory: str, pytest_args: Sequence[str]) -> None:
    """Run the store conformance suite against FACTORY (``module:callable``).

    The factory returns a fresh, empty, migrated store per test (it may take a ``tmp_path``
    argument, and may return a context manager yielding the store). Extra arguments go to
    pytest, e.g. ``-k claim -x``. Exits 0 when every test passed or was skipped.
    """
    # Imported here: pytest and the suite are needed by this command only.
    import pytest

    import outboxkit_conformance as suite

    try:
        make = suite.load_factory(factory)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    capabilities = _capabilities(make)
    echo(f"outboxkit conformance suite {suite.SUITE_VERSION} against {factory}")
    echo(f"declared capabilities: {', '.join(sorted(capabilities)) or 'none'}")
    counter = _Counter()
    ini = Path(suite.__file__).with_name("conformance.ini")
    args = [
        "-c",
        str(ini),
        "--rootdir",
        str(ini.parent),
        "--pyargs",
        "outboxkit_conformance",
        f"--outbox-store-factory={factory}",
        "-q",
        *pytest_args,
    ]
    code = pytest.main(args, plugins=[counter])
    echo(
        f"conformance: {counter.passed} passed, {counter.failed} failed, "
        f"{counter.skipped} skipped, {counter.xfailed} xfailed"
    )
    for name in counter.failures:
        echo(f"FAILED {name}")
    sys.exit(int(code))


def _capabilities(make: Any) -> frozenset[str]:
    """The capabilities a store made by ``make`` declares (the store is closed again)."""
    from outboxkit_conformance import call_factory

    with tempfile.TemporaryDirectory(prefix="outboxkit-conformance-") as tmp:
        try:
            made = call_factory(make, Path(tmp))
        except Exception as exc:
            raise click.ClickException(
                f"the store factory failed: {type(exc).__name__}: {exc}"
            ) from None
        if isinstance(made, AbstractContextManager):
            with made as store:
                return frozenset(store.capabilities)
        try:
            return frozenset(made.capabilities)
        finally:
            made.close()


class _Counter:
    """A pytest plugin counting outcomes, for the one-line summary."""

    def __init__(self) -> None:
        self.passed = self.failed = self.skipped = self.xfailed = 0
        self.failures: list[str] = []

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when == "call" and report.passed and not hasattr(report, "wasxfail"):
            self.passed += 1
        elif hasattr(report, "wasxfail") and report.skipped:
            self.xfailed += 1
        elif report.skipped:
            self.skipped += 1
        elif report.failed:
            self.failed += 1
            self.failures.append(report.nodeid)
