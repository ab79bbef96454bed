"""A smoke test of ``bench/compare.py``: every contender it measures (the minimal loops,
outboxkit's pollers, outboxkit's statements replayed bare; not the peers) drains a few hundred
events, each handled, settled and recorded exactly once. A correctness check of the harness,
never a timing one."""

from __future__ import annotations

import sqlite3
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
EVENTS = 150  # two claims of 100: a full batch, then a partial one

PG_CONTENDERS = [
    "ref-tx-1",
    "kit-tx-1",
    "ref-tx-2",
    "kit-tx-2",
    "ref-nontx-1",
    "kit-nontx-1",
    "ref-batch-1",
    "kit-batch-1",
    "kit-async-4",
    "bare-tx-1",
    "bare-batch-1",
    # a handler that writes one row (each drain also checks one row per event was written)
    "ref-w-tx-1",
    "kit-w-tx-1",
    "ref-w-batch-sp",
    "ref-w-batch",
    "kit-w-batch-1",
    "kit-w-async-4",
    "bare-w-tx-1",
    "bare-w-batch-1",
]
SQLITE_CONTENDERS = [
    "ref-sqlite-tx",
    "kit-sqlite-tx",
    "ref-sqlite-batch",
    "kit-sqlite-batch",
    "ref-w-sqlite-tx",
    "kit-w-sqlite-tx",
    "ref-w-sqlite-batch-sp",
    "ref-w-sqlite-batch",
    "kit-w-sqlite-batch",
    "bare-sqlite-tx",
    "bare-sqlite-batch",
    "bare-w-sqlite-tx",
    "bare-w-sqlite-batch",
]


@pytest.fixture(scope="module")
def compare():
    sys.path.insert(0, str(BENCH))  # the scripts import _common; spawned children inherit it
    try:
        import compare as module

        yield module
    finally:
        sys.path.remove(str(BENCH))
        sys.modules.pop("compare", None)
        sys.modules.pop("_common", None)


def test_every_contender_is_known(compare):
    assert set(PG_CONTENDERS + SQLITE_CONTENDERS) <= set(compare.CONTENDERS)
    for group in compare.GROUPS:
        assert set(group) <= set(compare.CONTENDERS)
    for workload in compare.WORKLOADS + compare.BARE_WORKLOADS:
        assert {workload.reference, *workload.outboxkit} <= set(compare.CONTENDERS)


def _drain_all(compare, names, url):
    """Every contender's outcome; they run side by side (each in its own schema or file)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        outcomes = list(
            pool.map(lambda n: compare.run_contender(compare.CONTENDERS[n], url, EVENTS), names)
        )
    for name, outcome in zip(names, outcomes, strict=True):
        assert outcome.name == name
        assert outcome.problems(EVENTS) == []
        assert (outcome.handled, outcome.settled, outcome.records) == (EVENTS,) * 3, name
        assert outcome.seconds > 0


@pytest.mark.pg
def test_pg_contenders_drain_every_event_once(compare):
    from tests.integration.pg import conftest as pg

    url = pg.test_url(pg.pg_url_from_env())
    pg.require_server(url)
    _drain_all(compare, PG_CONTENDERS, url)


@pytest.mark.pg
def test_pg_minimal_loops_claiming_by_primary_key_drain_every_event_once(compare, monkeypatch):
    """``--ref-claim-probe``: the minimal loops' claim by primary key (no reference, a
    diagnostic) is still a correct claim."""
    from tests.integration.pg import conftest as pg

    url = pg.test_url(pg.pg_url_from_env())
    pg.require_server(url)
    assert compare.PG_REF_CLAIM_PROBE != compare.PG_REF_CLAIM
    assert compare.ref_claim() is compare.PG_REF_CLAIM
    monkeypatch.setenv(compare.REF_CLAIM_PROBE_ENV, "1")  # the spawned workers inherit it
    assert compare.ref_claim() is compare.PG_REF_CLAIM_PROBE
    _drain_all(compare, ["ref-tx-1", "ref-batch-1"], url)


def test_sqlite_contenders_drain_every_event_once(compare):
    _drain_all(compare, SQLITE_CONTENDERS, "")


def test_the_table_and_the_readme_block(compare, tmp_path, monkeypatch):
    rates = {"ref-tx-1": [100.0, 120.0], "kit-tx-1": [95.0, 90.0]}
    rows = compare.summarize(compare.WORKLOADS, rates)
    assert [r.workload for r in rows] == ["pg-tx-1"]
    assert rows[0].ratio == pytest.approx(92.5 / 110)
    assert rows[0].met is False
    table = compare.results_table(rows)
    readme = tmp_path / "README.md"
    readme.write_text(f"# Benchmarks\n\n{compare.BEGIN_MARK}\nold\n{compare.END_MARK}\n\ntail\n")
    monkeypatch.setattr(compare, "README", readme)
    compare.update_readme(table, "header")
    text = readme.read_text()
    assert "old" not in text
    assert text.endswith(f"{table}\n{compare.END_MARK}\n\ntail\n")


def test_sqlite_statements_drains_every_event_on_both_sides(compare, tmp_path):
    """``bench/sqlite_statements.py``: both sides' statements drain every event, each timed."""
    sys.path.insert(0, str(BENCH))
    try:
        import sqlite_statements
    finally:
        sys.path.remove(str(BENCH))
        sys.modules.pop("sqlite_statements", None)
    minimal = sqlite_statements.minimal(tmp_path / "minimal.db", EVENTS)
    store = sqlite_statements.store_statements(tmp_path / "store.db", EVENTS)
    assert set(minimal) == {"claim", "records", "settle", "commit"}
    assert set(store) == {"claim", "claim commit", "records", "settle", "commit"}
    with closing(sqlite3.connect(tmp_path / "minimal.db")) as conn:
        assert conn.execute(
            "SELECT count(*) FROM ref_events WHERE published_at IS NOT NULL"
        ).fetchone() == (EVENTS,)
    with closing(sqlite3.connect(tmp_path / "store.db")) as conn:
        assert conn.execute(
            "SELECT count(*) FROM outbox_events WHERE published_at IS NOT NULL"
        ).fetchone() == (EVENTS,)
        assert conn.execute("SELECT count(*) FROM outbox_deliveries").fetchone() == (EVENTS,)


@pytest.mark.pg
def test_cpu_split_drains_every_event_with_each_drain(compare):
    """``bench/cpu_split.py``: the minimal loop, outboxkit's statements and the poller (with
    and without prefetch; and ``--writes``' drains, a handler writing a row) each drain every
    event (each drain checks it), measured."""
    from tests.integration.pg import conftest as pg

    url = pg.test_url(pg.pg_url_from_env())
    pg.require_server(url)
    sys.path.insert(0, str(BENCH))
    try:
        import cpu_split
    finally:
        sys.path.remove(str(BENCH))
        sys.modules.pop("cpu_split", None)
    for drains in (cpu_split.DRAINS, cpu_split.WRITING_DRAINS):
        splits = cpu_split.run(url, EVENTS, 1, drains)  # each drain checks every event
        assert list(splits) == list(drains)
        for got in splits.values():
            ((client, _server, wall),) = got  # the server's share is 0 for a server elsewhere
            assert client > 0 and wall > 0


def test_the_readme_header_names_the_command_that_gave_the_figures(compare):
    import argparse

    def line(**given):
        args = {"bare": False, "events": 10_000, "rounds": 3, "only": []} | given
        return compare.command_line(argparse.Namespace(**args))

    assert line() == "python bench/compare.py"
    assert line(bare=True, rounds=5) == "python bench/compare.py --bare --rounds 5"
    assert (
        line(events=2000, only=["pg-tx-1", "sqlite-event"])
        == "python bench/compare.py --events 2000 --only pg-tx-1 --only sqlite-event"
    )
