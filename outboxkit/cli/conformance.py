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
    # Imported here: pytest is needed by this command only. The suite itself is imported by
    # pytest's session (``_Run.pytest_sessionstart``), after pytest's import hook is in place:
    # its checks are plain asserts, rewritten like a test's so that a failure shows its values.
    import pytest

    run = _Run(factory)
    args = [
        "-c",
        str(_suite_ini()),
        "--rootdir",
        str(_suite_ini().parent),
        "--pyargs",
        "outboxkit_conformance",
        f"--outbox-store-factory={factory}",
        "-q",
        *pytest_args,
    ]
    code = pytest.main(args, plugins=[run])
    if run.error is not None:
        sys.exit(2)  # pytest has printed it ("ERROR: ..."), as a usage error
    echo(
        f"conformance: {run.passed} passed, {run.failed} failed, "
        f"{run.skipped} skipped, {run.xfailed} xfailed"
    )
    for name in run.failures:
        echo(f"FAILED {name}")
    sys.exit(int(code))


def _suite_ini() -> Path:
    """The suite's ``conformance.ini``, found without importing the suite."""
    import importlib.util

    spec = importlib.util.find_spec("outboxkit_conformance")
    if spec is None or spec.origin is None:
        raise click.ClickException("the conformance suite (outboxkit_conformance) is not installed")
    return Path(spec.origin).with_name("conformance.ini")


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


class _Run:
    """A pytest plugin: loads the factory and prints the header once the session starts (the
    suite imported then, under pytest's assertion rewriting), and counts the outcomes for the
    one-line summary."""

    def __init__(self, factory: str) -> None:
        self.factory = factory
        self.error: str | None = None
        self.passed = self.failed = self.skipped = self.xfailed = 0
        self.failures: list[str] = []

    def pytest_sessionstart(self, session: Any) -> None:
        import pytest

        import outboxkit_conformance as suite

        try:
            make = suite.load_factory(self.factory)
            capabilities = _capabilities(make)
        except (ValueError, click.ClickException) as exc:
            self.error = exc.message if isinstance(exc, click.ClickException) else str(exc)
            raise pytest.UsageError(self.error) from None
        echo(f"outboxkit conformance suite {suite.SUITE_VERSION} against {self.factory}")
        echo(f"declared capabilities: {', '.join(sorted(capabilities)) or 'none'}")

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
