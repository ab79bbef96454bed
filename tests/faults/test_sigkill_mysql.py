"""SIGKILL and ``KILL CONNECTION`` chaos on MariaDB/MySQL.

Four ``outboxkit run`` processes on one database (two per event, two per batch), each event's
transactional handler writing one ``ledger`` row through ``ctx.connection``. While events arrive
in chunks, every half second either a random poller is SIGKILLed (and a new one spawned in its
place) or a random connection of the pollers' is killed by the server (``KILL CONNECTION``:
what a failover or an operator does). Then a fault-free drain in this process, and the figures:

- lost: events without their ledger row;
- dup_tx: ledger rows written twice (a transactional handler's write must happen once);
- stuck: events neither published nor dead after the drain; dead: events dead-lettered;
- unrecorded: events whose ledger row has no succeeded record, or the other way round.

Sizes: 600 events and 12 faults; with ``OUTBOXKIT_FAULTS_SCALE=large``, 3,000 events and 40.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pymysql
import pytest

from outboxkit import Event, EventBus, Outbox, StoreUnavailable
from outboxkit_mysql import MySQLStore
from tests.faults._scale import scale
from tests.integration.mysql import server

pytestmark = [pytest.mark.mysql, pytest.mark.faults]

EVENTS = scale(pr=600, large=3000)
CHUNK = 25
FAULTS = scale(pr=12, large=40)
EVERY = 0.5
MODES = ("per_event", "per_event", "per_batch", "per_batch")

APP = """
import os

from outboxkit import EventBus, Outbox, open_store

bus = EventBus()


@bus.handler("job", name="ledger")
def ledger(event, ctx):
    with ctx.connection.cursor() as cur:
        cur.execute("INSERT INTO ledger (event_id) VALUES (%s)", (event.id,))


outbox = Outbox(open_store(os.environ["FAULT_MYSQL_URL"], pool_size=2), bus)
"""


def ledger_bus() -> EventBus:
    bus = EventBus()

    @bus.handler("job", name="ledger")
    def ledger(event: Event, ctx: Any) -> None:
        with ctx.connection.cursor() as cur:
            cur.execute("INSERT INTO ledger (event_id) VALUES (%s)", (event.id,))

    return bus


class Pollers:
    """``outboxkit run`` processes on the test's database."""

    def __init__(self, url: str, folder: Path) -> None:
        (folder / "faultapp.py").write_text(APP)
        self.env = {**os.environ, "FAULT_MYSQL_URL": url, "PYTHONPATH": str(folder)}
        self.folder = folder
        self.live: list[subprocess.Popen[bytes]] = []
        self.dead: list[subprocess.Popen[bytes]] = []
        self.spawned = 0

    def spawn(self) -> None:
        mode = MODES[self.spawned % len(MODES)]
        self.spawned += 1
        command = [str(Path(sys.executable).with_name("outboxkit")), "run", "faultapp:outbox"]
        options = ["--batch-size", "10", "--lease", "2s", "--interval", "50ms"]
        self.live.append(
            subprocess.Popen(
                [*command, *options, "--transaction", mode],
                cwd=self.folder,
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )

    def kill(self, rng: random.Random) -> None:
        proc = self.live.pop(rng.randrange(len(self.live)))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        self.dead.append(proc)
        self.spawn()

    def stop(self) -> list[int]:
        """SIGTERM each live poller once it handles SIGTERM (a poller spawned just before may
        still be importing, and SIGTERM's default would end it), and their exit codes."""
        deadline = time.monotonic() + 30
        for proc in self.live:
            while not catches_sigterm(proc.pid) and proc.poll() is None:
                if time.monotonic() > deadline:
                    raise AssertionError(f"poller {proc.pid} never installed its SIGTERM handler")
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.02)
            proc.send_signal(signal.SIGTERM)
        return [proc.wait(timeout=30) for proc in self.live]


def catches_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a handler for SIGTERM (its ``SigCgt`` mask in ``/proc``)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


def kill_a_connection(
    admin: pymysql.connections.Connection, database: str, rng: random.Random, spare: int
) -> int:
    """``KILL CONNECTION`` one of the pollers' connections (on the test's database, but the
    ``spare`` one: the enqueuer's); 1 if one was."""
    with admin.cursor() as cur:
        cur.execute(
            "SELECT id FROM information_schema.processlist"
            " WHERE db = %s AND id <> CONNECTION_ID() AND id <> %s",
            (database, spare),
        )
        ids = [row[0] for row in cur.fetchall()]
        if not ids:
            return 0
        try:
            cur.execute("KILL CONNECTION %s", (rng.choice(ids),))
        except pymysql.err.OperationalError:
            return 0  # it ended meanwhile
    return 1


def one(admin: pymysql.connections.Connection, query: str) -> int:
    with admin.cursor() as cur:
        cur.execute(query)
        return int(cur.fetchone()[0])


def test_sigkill_and_killed_connections(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(35)
    with server.fresh_database(prefix="okfault") as url:
        database = url.rsplit("/", 1)[1]
        admin = pymysql.connect(**server.connect_args(url), database=database, autocommit=True)
        store = MySQLStore(url)
        try:
            store.migrate()
            with admin.cursor() as cur:
                cur.execute("CREATE TABLE ledger (event_id BIGINT NOT NULL) ENGINE=InnoDB")
            outbox = Outbox(store, ledger_bus())
            pollers = Pollers(url, tmp_path)
            for _ in MODES:
                pollers.spawn()
            kills = killed_connections = sent = 0
            pause = threading.Event()
            app = pymysql.connect(**server.connect_args(url), database=database)
            started = time.monotonic()
            for fault in range(FAULTS):
                while sent < EVENTS * (fault + 1) // FAULTS:
                    outbox.enqueue_many(app, [("job", {"n": sent + i}) for i in range(CHUNK)])
                    app.commit()
                    sent += CHUNK
                pause.wait(EVERY)
                if fault % 2 == 0:
                    pollers.kill(rng)
                    kills += 1
                else:
                    killed_connections += kill_a_connection(admin, database, rng, app.thread_id())
            app.close()
            exit_codes = pollers.stop()
            chaos_seconds = time.monotonic() - started
            drained = drain(outbox, timeout=60)
            events = one(admin, "SELECT COUNT(*) FROM outbox_events")
            lost = one(
                admin,
                "SELECT COUNT(*) FROM outbox_events e"
                " WHERE NOT EXISTS (SELECT 1 FROM ledger l WHERE l.event_id = e.id)",
            )
            dup_tx = one(admin, "SELECT COUNT(*) - COUNT(DISTINCT event_id) FROM ledger")
            stuck = one(
                admin,
                "SELECT COUNT(*) FROM outbox_events WHERE published_at IS NULL"
                " AND failed_at IS NULL",
            )
            dead = one(admin, "SELECT COUNT(*) FROM outbox_events WHERE failed_at IS NOT NULL")
            unrecorded = one(
                admin,
                "SELECT COUNT(*) FROM outbox_events e WHERE"
                " (SELECT COUNT(*) FROM outbox_deliveries d WHERE d.event_id = e.id"
                "   AND d.handler = 'ledger' AND d.outcome = 'succeeded')"
                " <> (SELECT COUNT(*) FROM ledger l WHERE l.event_id = e.id)",
            )
        finally:
            store.close()
            admin.close()
    with capsys.disabled():
        print(
            f"\n[faults:sigkill-mysql] {events} events, {len(MODES)} pollers, {kills} SIGKILLs, "
            f"{killed_connections} killed connections in {chaos_seconds:.1f}s: lost={lost} "
            f"dup_tx={dup_tx} stuck={stuck} dead={dead} unrecorded={unrecorded}"
        )
    assert drained
    assert events == EVENTS
    assert (lost, dup_tx, stuck, dead, unrecorded) == (0, 0, 0, 0, 0)
    assert kills == (FAULTS + 1) // 2 and killed_connections >= 1
    # The survivors stopped cleanly on SIGTERM (each sent once it handled it).
    assert exit_codes == [0] * len(MODES), exit_codes


def drain(outbox: Outbox, *, timeout: float) -> bool:
    """Poll here until nothing is pending or leased (killed pollers' leases run out). A
    connection of this store killed during the chaos fails its next use: waited out, as
    ``run_forever`` does."""
    poller = outbox.poller(batch_size=100, lease=5.0)
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while time.monotonic() < deadline:
        try:
            report = poller.run_once()
        except StoreUnavailable:
            continue
        if not report.claimed:
            stats = outbox.stats()
            if stats.pending == 0 and stats.claimed == 0:
                return True
            pause.wait(0.2)
    return False
