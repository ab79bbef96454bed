"""The project's own promises: the README's commands and examples work as written."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
TEST_COMMAND = "python -m pytest -q -n 2"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert TEST_COMMAND in README
    assert re.search(rf"^{re.escape(TEST_COMMAND)}$", ci, flags=re.M)


def test_readme_quick_start_runs() -> None:
    quick_start = python_blocks(README)[0]
    namespace: dict[str, object] = {"__name__": "readme_quick_start"}
    exec(compile(quick_start, "README.md", "exec"), namespace)
    store = namespace["store"]
    stats = store.stats(now=None)  # type: ignore[attr-defined]
    # reserve-stock succeeded (and enqueued a follow-up), send-receipt succeeded: published.
    assert stats.published == 1
    assert stats.pending == 1  # the follow-up "stock.reserved", not yet polled


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
    section = README.split("## Testing with outboxkit", 1)[1]
    example = python_blocks(section)[0]
    pytester.makepyfile(test_checkout=example)
    # A user's project, as the README shows it; pytest-asyncio (installed for our own async
    # tests) would ask such a project to choose its fixture loop scope.
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")  # default: SQLite
    result.assert_outcomes(passed=2)
