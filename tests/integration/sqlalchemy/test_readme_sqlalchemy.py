"""The README's SQLAlchemy section runs as written: its app (``bookshop.py``) and its tests
(``test_bookshop.py``) pass on a SQLite file of their own, warnings made errors."""

from __future__ import annotations

import pytest

from tests.docs import page, python_blocks

SECTION = page("how-to/sqlalchemy.md")
BLOCKS = {block.splitlines()[0].split()[1]: block for block in python_blocks(SECTION)}


def test_every_python_block_of_the_section_is_run_here() -> None:
    assert list(BLOCKS) == ["bookshop.py", "test_bookshop.py"]


def test_the_sections_tests_pass(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(bookshop=BLOCKS["bookshop.py"], test_bookshop=BLOCKS["test_bookshop.py"])
    pytester.makeini(
        "[pytest]\nasyncio_default_fixture_loop_scope = function\nfilterwarnings = error\n"
    )
    pytester.syspathinsert()
    monkeypatch.setenv("SHOP_DATABASE", f"sqlite:///{(pytester.path / 'test.db').as_posix()}")
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)
