"""Acceptance 8: an unreachable server gives a clear error naming host and port, never the
password. No server is needed: nothing listens on port 1."""

from __future__ import annotations

import logging
import threading
import traceback
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import errors as pg_errors

from outboxkit import Outbox, StoreError, StoreUnavailable, open_store
from outboxkit_pg import PostgresStore

PASSWORD = "s3cr3t-Pa55w0rd"
URL = f"postgresql://outbox_user:{PASSWORD}@127.0.0.1:1/outbox_db"
CONNINFO = f"host=127.0.0.1 port=1 dbname=outbox_db user=outbox_user password={PASSWORD}"


def full_text(exc: BaseException) -> str:
    """The exception as a traceback prints it, with every cause and context."""
    return "".join(traceback.format_exception(exc))


@pytest.mark.parametrize("conninfo", [URL, CONNINFO], ids=["url", "conninfo"])
def test_unreachable_server_is_named_without_the_password(conninfo: str) -> None:
    store = PostgresStore(conninfo, pool_timeout=0.5)
    try:
        assert PASSWORD not in repr(store)
        for call in (
            store.migrate,
            lambda: store.claim(batch_size=10, lease=timedelta(seconds=30), now=None),
            lambda: store.stats(now=None),
        ):
            with pytest.raises(StoreUnavailable) as caught:
                call()
            message = str(caught.value)
            assert "127.0.0.1:1" in message
            assert "outbox_db" in message
            assert "Connection refused" in message or "connection" in message.lower()
            assert PASSWORD not in full_text(caught.value)
    finally:
        store.close()


def test_open_store_url_too() -> None:
    store = open_store(URL, pool_timeout=0.5)
    try:
        with pytest.raises(StoreUnavailable, match=r"127\.0\.0\.1:1") as caught:
            store.migrate()
        assert PASSWORD not in full_text(caught.value)
        assert store.url == URL  # what another process needs to open the same store
    finally:
        store.close()


def test_poller_logs_the_outage_without_the_password(caplog: pytest.LogCaptureFixture) -> None:
    store = PostgresStore(URL, pool_timeout=0.2)
    poller = Outbox(store).poller(interval=0.05)
    outage = threading.Event()

    class StopOnOutage(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "store unavailable" in record.getMessage():
                outage.set()
                poller.stop()

    handler = StopOnOutage()
    logging.getLogger("outboxkit").addHandler(handler)
    try:
        with caplog.at_level(logging.INFO):
            runner = threading.Thread(target=poller.run_forever)
            runner.start()
            assert outage.wait(30), "run_forever never reported the outage"
            runner.join(30)
            assert not runner.is_alive()
    finally:
        logging.getLogger("outboxkit").removeHandler(handler)
        store.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1  # logged once per outage
    assert "127.0.0.1:1" in errors[0].getMessage()
    assert PASSWORD not in caplog.text


# The mapping of a driver error to outboxkit's (no server needed: the errors are built here).

ENDED = {
    "25P03": "terminating connection due to idle-in-transaction timeout",
    "57P01": "terminating connection due to administrator command",
    "57P02": "terminating connection because of crash of another server process",
    "57P03": "the database system is starting up",
    "57P05": "terminating connection due to idle-session timeout",
    "08006": "connection failure",
    "08003": "connection does not exist",
}


@pytest.mark.parametrize("sqlstate", sorted(ENDED))
def test_a_connection_the_server_ended_is_store_unavailable(sqlstate: str) -> None:
    # 25P03 is a psycopg InternalError, not an OperationalError: the SQLSTATE decides.
    exc = pg_errors.lookup(sqlstate)(ENDED[sqlstate])
    assert exc.sqlstate == sqlstate
    store = PostgresStore(URL)  # never connects
    error = store.dialect.error(exc, "commit the delivery of event 7")
    store.close()
    assert isinstance(error, StoreUnavailable), repr(error)
    assert "commit the delivery of event 7" in str(error) and ENDED[sqlstate] in str(error)
    assert PASSWORD not in str(error)


class _BrokenConnection:
    broken = True


def test_an_error_on_a_broken_connection_is_store_unavailable() -> None:
    store = PostgresStore(URL)  # never connects
    broken: Any = _BrokenConnection()
    error = store.dialect.error(psycopg.DatabaseError("lost"), "settle event 7", broken)
    assert isinstance(error, StoreUnavailable), repr(error)
    # Any other database error stays a plain StoreError.
    other = store.dialect.error(pg_errors.lookup("23505")("duplicate key"), "settle event 7")
    assert type(other) is StoreError, repr(other)
    store.close()
