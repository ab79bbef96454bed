"""A database outage as ``outboxkit run`` logs it: every line in the one format (the driver's
too, psycopg_pool's included), the driver's repeats logged once with the real cause, and the
poller going on afterwards. The outage is a TCP proxy cut between the poller and the server
(``tests/tcpproxy.py``): the server others use is never stopped."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from outboxkit import Outbox
from tests.backends import open_target
from tests.tcpproxy import running_proxy

from .apps import write_app
from .conftest import Cli, Procs, wait_for

pytestmark = pytest.mark.pg

LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) [\w.]+: ")


def _through(url: str, port: int) -> str:
    parts = urlsplit(url)
    user = parts.netloc.rpartition("@")[0]
    return urlunsplit(parts._replace(netloc=f"{user}@127.0.0.1:{port}"))


def test_an_outage_is_logged_once_with_its_cause_in_the_one_format(
    process_cli: Cli, tmp_path: Path, procs: Procs
) -> None:
    with open_target("pg", tmp_path) as target:
        server = urlsplit(target.url)
        with running_proxy(server.hostname or "127.0.0.1", server.port or 5432) as proxy:
            url = _through(target.url, proxy.port)
            store = target.open()
            store.migrate()
            app = write_app(tmp_path / "app")
            env = {
                "CLI_TEST_STORE": url,
                "CLI_TEST_STORE_OPTIONS": json.dumps({"schema": target.options["schema"]}),
            }
            proc = procs.start(process_cli, ["run", app.spec(), "--interval", "50ms"], env=env)
            proc.wait_for_log("polling PostgresStore")
            outbox = Outbox(store, load_entry_points=False)
            proxy.cut()
            # When the pool meets the outage first (its reconnect refused), a poll reports it
            # once its wait for a connection ends: pool_timeout, 10 s, on a loaded machine more.
            proc.wait_for_log("store unavailable", timeout=90)
            # Several polls and the pool's own attempts fail meanwhile: all logged once.
            wait_for(lambda: proxy.refused >= 6, "six connection attempts refused", timeout=90)
            proxy.restore()
            with store.transaction() as conn:
                event = outbox.enqueue(conn, "order.placed", {"n": 1})
            wait_for(
                lambda: getattr(store.get(event), "published_at", None) is not None,
                "the event published after the outage",
                timeout=90,
            )
            proc.popen.send_signal(signal.SIGTERM)
            assert proc.popen.wait(timeout=30) == 0, proc.report()
            store.close()
    log = proc.stderr()
    lines = log.splitlines()
    # Every line in the one format: no bare driver message, no multi-line libpq text.
    assert lines and all(LINE.match(line) for line in lines), log
    # Logged once, with the cause (libpq's words), then once when it is over.
    [down] = [line for line in lines if "store unavailable" in line]
    assert " ERROR outboxkit: " in down, log
    assert re.search(r"server closed the connection|Connection reset by peer", down), log
    assert len(re.findall(r"store available again after \d+ failed poll\(s\)", log)) == 1, log
    # The pool's own lines (whether the pool or a poll meets the outage first varies): each
    # kind at most once, though psycopg_pool logs every failed attempt (six and more here).
    pool = [line for line in lines if " psycopg.pool: " in line]
    assert len(pool) == len({line.split(": ", 2)[1].split(":")[0] for line in pool}), log
    assert all("logged at most once per 60s" in line for line in pool), log
    assert "no free connection in the pool" not in log, log
