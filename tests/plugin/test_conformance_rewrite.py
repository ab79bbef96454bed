"""A conformance failure shows its values: the suite's modules are assert-rewritten (the
plugin registers them before the suite is imported)."""

from __future__ import annotations

import pytest

BROKEN_STORE = """
from dataclasses import replace
from outboxkit import MemoryStore


class OffByOne(MemoryStore):
    def stats(self, *, now):
        stats = super().stats(now=now)
        return replace(stats, pending=stats.pending + 1)


def make_store():
    return OffByOne()
"""


def test_a_conformance_failure_shows_its_values(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(brokenstore=BROKEN_STORE)
    pytester.syspathinsert()
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    result = pytester.runpytest_subprocess(
        "--pyargs",
        "outboxkit_conformance",
        "--outbox-store-factory=brokenstore:make_store",
        "-k",
        "test_stats_counts_by_state_and_topic and not asyncio",
        "-p",
        "no:cacheprovider",
        "-W",
        "error",
    )
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "assert (3, 1, 1, 1) == (2, 1, 1, 1)" in text
    assert "PytestAssertRewriteWarning" not in text
