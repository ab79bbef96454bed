"""The project's own promises: the README's commands and examples work as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs import page

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
TEST_COMMAND = "python -m pytest -q -n 2"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert TEST_COMMAND in README
    assert re.search(rf"^{re.escape(TEST_COMMAND)}$", ci, flags=re.M)


def test_readmes_app_and_its_test_pass(pytester: pytest.Pytester) -> None:
    """The README's first Python block is an app with its test, run as the block says."""
    example = python_blocks(page("README.md"))[0]
    assert example.startswith("# test_orders.py")
    pytester.makepyfile(test_orders=example)
    pytester.makeini(
        "[pytest]\nasyncio_default_fixture_loop_scope = function\nfilterwarnings = error\n"
    )
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_readme_stays_short() -> None:
    assert len(README.splitlines()) <= 200


def test_py_typed_markers_ship() -> None:
    for package in (
        "outboxkit",
        "outboxkit_pg",
        "outboxkit_sqlite",
        "outboxkit_mysql",
        "conformance/outboxkit_conformance",
    ):
        assert (ROOT / package / "py.typed").is_file(), package


def test_readme_testing_example_passes(pytester) -> None:
    example = python_blocks(page("how-to/testing.md"))[0]
    pytester.makepyfile(test_checkout=example)
    # A user's project, as the README shows it; pytest-asyncio (installed for our own async
    # tests) would ask such a project to choose its fixture loop scope.
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")  # default: SQLite
    result.assert_outcomes(passed=2)
