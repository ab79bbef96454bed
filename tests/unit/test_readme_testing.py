"""The testing page (how-to/testing.md) runs as written: its second example (the kit's other tools) on
memory, SQLite and PostgreSQL, as CI runs it."""

from __future__ import annotations

import pytest

from tests.backends import ALL_BACKENDS
from tests.docs import page, python_blocks

SECTION = page("how-to/testing.md")
BLOCKS = [b for b in python_blocks(SECTION) if b.startswith("# test_")]


def test_the_chapter_shows_both_test_files() -> None:
    assert [b.splitlines()[0].split()[1] for b in BLOCKS] == [
        "test_checkout.py",
        "test_checkout_more.py",
    ]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_the_kits_other_tools_run_on_every_store(pytester: pytest.Pytester, backend: str) -> None:
    args = []
    if backend == "memory":
        args = ["--outbox-store=memory://"]
    elif backend == "pg":
        from tests.integration.pg.conftest import pg_url_from_env, require_server
        from tests.integration.pg.conftest import test_url as pg_test_url

        url = pg_url_from_env()
        require_server(url)
        args = [f"--outbox-store={pg_test_url(url)}"]
    pytester.makepyfile(test_checkout_more=BLOCKS[1])
    pytester.makeini(
        "[pytest]\nasyncio_default_fixture_loop_scope = function\nfilterwarnings = error\n"
    )
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider", *args)
    result.assert_outcomes(passed=4)
