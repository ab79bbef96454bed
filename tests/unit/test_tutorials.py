"""The tutorial "Test your first outbox app" runs as written: its ``shop.py`` and
``test_shop.py``, saved as the page says, pass under pytest (warnings made errors). ``.ci/run``
also follows it in a fresh virtual environment, its commands as written."""

from __future__ import annotations

import sys

import pytest

from tests.docs import blocks, page, python_blocks

PAGE = page("tutorials/first-test.md")


def files() -> dict[str, str]:
    return {block.splitlines()[0].split()[1]: block for block in python_blocks(PAGE)}


def test_the_tutorial_shows_two_files_and_the_commands_to_run_them() -> None:
    assert list(files()) == ["shop.py", "test_shop.py"]
    commands = blocks(PAGE, "bash")
    assert commands[0].startswith("python3 -m venv .venv && . .venv/bin/activate && pip install")
    assert commands[-1].strip() == "python -m pytest -q test_shop.py"


def test_the_tutorials_tests_pass(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("shop", "test_shop"):  # another test's module of that name is not the tutorial's
        monkeypatch.delitem(sys.modules, name, raising=False)
    shown = files()
    pytester.makepyfile(shop=shown["shop.py"], test_shop=shown["test_shop.py"])
    # A new project's ini: pytest-asyncio (installed for outboxkit's own tests, not the
    # tutorial's) asks such a project to choose its loop scope.
    pytester.makeini(
        "[pytest]\nasyncio_default_fixture_loop_scope = function\nfilterwarnings = error\n"
    )
    pytester.syspathinsert()
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider", "test_shop.py")
    result.assert_outcomes(passed=4)
