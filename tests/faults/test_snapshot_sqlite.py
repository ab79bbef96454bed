"""A reader holding a read snapshot while 20,000 events go through one SQLite file.

Another connection to the file runs ``BEGIN; SELECT ...`` and keeps that transaction open while
the app enqueues 20,000 events (``enqueue_many``, 1,000 per transaction) and a poller in this
process drains them chunk by chunk (one transactional ``ledger`` handler per topic: the harness's
bus without the mailer, one delivery transaction per event, to stay within the time budget).
WAL mode lets the reader and the writers go on side by side, but no checkpoint can move past the
reader's snapshot, so the WAL cannot be reset and every commit appends to it.

Checked, with the reader (``held``) and, as the control, without it (``none``):

- outboxkit's own connections are never left in a transaction between polls (after every
  ``run_once`` each of the store's connections has ``in_transaction`` False), and every event is
  delivered exactly once;
- the WAL stays under ``WAL_BOUND``, or else outboxkit logs a warning about it. Without the
  reader SQLite's automatic checkpoints (every 1,000 pages, 4 MiB) keep it near 4 MB. With the
  reader no checkpoint can get past its snapshot and the WAL grows by about 30 kB per event (some
  600 MB here): the store notices (it looks at the WAL's size after a commit, every few seconds
  by default and here after every commit, and over ``wal_warn_bytes``, 64 MiB, tries a passive
  checkpoint) and logs a warning on
  ``outboxkit.sqlite`` naming the file and telling to end long-lived read transactions;
- once the reader has ended, the next checkpoint resets the WAL and ``journal_size_limit``
  (32 MiB) shrinks the file back under ``WAL_BOUND``.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from outboxkit import Outbox
from outboxkit_sqlite import SQLiteStore
from outboxkit_sqlite import connections as sqlite_connections
from tests.faults._harness_sqlite import (
    APP_TIMEOUT,
    Figures,
    create_app_tables,
    figures,
    make_bus,
    messages,
)

pytestmark = [pytest.mark.faults]

EVENTS = 20_000
CHUNK = 1_000
BATCH = 100
MB = 1_000_000
WAL_BOUND = 64 * MB  # 16x what SQLite's automatic checkpoints keep it at with no long reader


class _Warnings(logging.Handler):
    """Every record at WARNING or above on the ``outboxkit`` loggers (caplog is per test; the
    scenario runs once per module)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.name}: {record.getMessage()}")


@dataclass
class Run:
    reader: str
    path: str = ""
    seconds: float = 0.0
    polls: int = 0
    connections_seen: int = 0
    left_in_transaction: list[int] = field(default_factory=list)  # poll numbers
    wal_peak: int = 0
    wal_after_reader: int = 0  # after the reader ended and one more chunk went through
    snapshot_before: int = -1
    snapshot_after: int = -1
    warnings: list[str] = field(default_factory=list)
    figures: Figures | None = None

    def line(self) -> str:
        assert self.figures is not None
        return (
            f"reader={self.reader} {EVENTS} events, {self.seconds:.1f}s: "
            f"wal peak {self.wal_peak / MB:.1f} MB (bound {WAL_BOUND / MB:.0f} MB), "
            f"{self.wal_after_reader / MB:.1f} MB after the reader ended; "
            f"outboxkit warnings {len(self.warnings)}; "
            f"store connections in a transaction after a poll: {len(self.left_in_transaction)} "
            f"of {self.polls} polls; {self.figures.line()}"
        )


def _connections(store: SQLiteStore) -> list[sqlite3.Connection]:
    """The store's own connections (private: ``_Connections`` keeps the idle ones between
    calls; a file database has no shared one)."""
    pool = store.dialect.connections
    return [*pool._idle, *([pool._shared] if pool._shared is not None else [])]


def _wal_size(path: Path) -> int:
    wal = Path(f"{path}-wal")
    return wal.stat().st_size if wal.exists() else 0


def _scenario(path: Path, reader_mode: str) -> Run:
    run = Run(reader_mode, path=str(path))
    create_app_tables(path)
    warnings = _Warnings()
    logger = logging.getLogger("outboxkit")
    logger.addHandler(warnings)
    reader = sqlite3.connect(path, timeout=APP_TIMEOUT, isolation_level=None)
    app = sqlite3.connect(path, timeout=APP_TIMEOUT)
    started = time.monotonic()
    try:
        with pytest.MonkeyPatch.context() as patch:
            # Look at the WAL after every commit, not every few seconds (from the store's first
            # commit on): how long the drain takes must not decide whether the store looks.
            patch.setattr(sqlite_connections, "WAL_CHECK_INTERVAL", 0.0)
            with SQLiteStore(path) as store:
                if reader_mode == "held":
                    reader.execute("BEGIN")
                    (run.snapshot_before,) = reader.execute(
                        "SELECT count(*) FROM outbox_events"
                    ).fetchone()
                outbox = Outbox(store, make_bus(None), load_entry_points=False)
                poller = outbox.poller(batch_size=BATCH)

                def drain_chunk() -> None:
                    while True:
                        report = poller.run_once()
                        run.polls += 1
                        own = _connections(store)
                        run.connections_seen = max(run.connections_seen, len(own))
                        if not own or any(conn.in_transaction for conn in own):
                            run.left_in_transaction.append(run.polls)
                        run.wal_peak = max(run.wal_peak, _wal_size(path))
                        if not report.claimed:
                            return

                for start in range(0, EVENTS, CHUNK):
                    with app:  # the app's transaction
                        outbox.enqueue_many(app, messages(CHUNK, start=start))
                    drain_chunk()
                if reader_mode == "held":
                    (run.snapshot_after,) = reader.execute(
                        "SELECT count(*) FROM outbox_events"
                    ).fetchone()
                    reader.execute("COMMIT")
                run.seconds = time.monotonic() - started
                # The reader is gone: one more chunk, so SQLite's automatic checkpoint can run.
                with app:
                    outbox.enqueue_many(app, messages(CHUNK, start=EVENTS))
                drain_chunk()
                run.wal_after_reader = _wal_size(path)
    finally:
        logger.removeHandler(warnings)
        reader.close()
        app.close()
    run.warnings = warnings.messages
    run.figures = figures(path, EVENTS + CHUNK, traces=[])
    # Give the disk back (hundreds of MB with the reader): truncate the WAL.
    with closing(sqlite3.connect(path, timeout=APP_TIMEOUT)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return run


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Run]]:
    """The scenario for a reader mode, run once per module and mode (the tests share it)."""
    runs: dict[str, Run] = {}
    directories: list[Path] = []

    def get(reader_mode: str) -> Run:
        if reader_mode not in runs:
            directories.append(tmp_path_factory.mktemp(f"snapshot-{reader_mode}"))
            runs[reader_mode] = _scenario(directories[-1] / "outbox.db", reader_mode)
        return runs[reader_mode]

    yield get
    for directory in directories:
        for file in directory.glob("outbox.db*"):
            os.unlink(file)


@pytest.mark.parametrize("reader_mode", ["held", "none"])
def test_store_connections_are_never_left_in_a_transaction_between_polls(
    scenario: Callable[[str], Run], reader_mode: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run = scenario(reader_mode)
    with capsys.disabled():
        print(f"\n[faults:snapshot-sqlite] {run.line()}")
    assert run.polls >= EVENTS // BATCH
    assert run.connections_seen >= 1  # the check looked at real connections
    assert run.left_in_transaction == []
    assert run.figures is not None
    assert run.figures.invariants() == (0, 0, 0, 0, 0)
    if reader_mode == "held":
        # The reader's snapshot really was held throughout: it never saw an event.
        assert (run.snapshot_before, run.snapshot_after) == (0, 0)


@pytest.mark.parametrize("reader_mode", ["held", "none"])
def test_the_wal_stays_bounded_or_outboxkit_warns(
    scenario: Callable[[str], Run], reader_mode: str
) -> None:
    run = scenario(reader_mode)
    wal_warnings = [m for m in run.warnings if "wal" in m.lower() or "checkpoint" in m.lower()]
    if reader_mode == "held":  # the reader really stopped the checkpoints: warned, once a minute
        assert run.wal_peak > WAL_BOUND
        assert 1 <= len(wal_warnings) <= 2 + int(run.seconds // 60), run.warnings
        assert "read transaction" in wal_warnings[0] and str(run.path) in wal_warnings[0]
    else:
        assert wal_warnings == []
    assert run.wal_peak < WAL_BOUND or wal_warnings, (
        f"WAL peaked at {run.wal_peak / MB:.1f} MB (bound {WAL_BOUND / MB:.0f} MB) and "
        f"outboxkit logged no warning about it (warnings: {run.warnings})"
    )
    # Once the reader is gone the file comes back under the bound by itself.
    assert run.wal_after_reader < WAL_BOUND
