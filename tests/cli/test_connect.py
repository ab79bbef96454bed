"""One-shot commands against a PostgreSQL server that is not there, or refuses the password:
one line on stderr naming host, port and database, exit code 2, in under 2 s (in process;
through a subprocess, whose start a loaded machine makes vary by seconds, in under 5 s past a
run of the same command that fails before connecting), no password.

The wrong password is refused by a tiny fake server on a free loopback port that speaks the
start of PostgreSQL's protocol (it answers an ``SSLRequest`` with ``N``, asks for a cleartext
password, reads it, and answers with SQLSTATE 28P01): the test server trusts local connections
and never checks a password, and a fake one costs milliseconds where a private cluster with
scram authentication costs seconds of ``initdb``. libpq cannot tell the difference: what it
reads is byte for byte what a server sends.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import closing, suppress

import pytest

from .conftest import Cli

PASSWORD = "Sup3r$ecretPw"
ENCODED = "Sup3r%24ecretPw"
LIMIT = 2.0  # seconds a one-shot command may take to give up
# A subprocess's start varies by seconds on a loaded machine (two cores, many test workers), so
# there the bound is looser, yet far below the 10 s pool_timeout a pool waiting would take.
PROCESS_LIMIT = 5.0

_SSL_REQUEST = 80877103
_GSSENC_REQUEST = 80877104


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the client hung up")
        data += chunk
    return data


def _error_response(sqlstate: str, message: str) -> bytes:
    fields = b"".join(
        code + value.encode() + b"\0"
        for code, value in ((b"S", "FATAL"), (b"V", "FATAL"), (b"C", sqlstate), (b"M", message))
    )
    body = fields + b"\0"
    return b"E" + struct.pack("!i", len(body) + 4) + body


class FakeServer:
    """Refuses every password it is sent, remembering each one (to show the client sent it)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)  # the accept loop checks for the end this often
        self.port: int = self.sock.getsockname()[1]
        self.passwords: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with closing(conn):
                conn.settimeout(5)
                with suppress(ConnectionError, TimeoutError, OSError):
                    self._session(conn)

    def _session(self, conn: socket.socket) -> None:
        while True:
            (length,) = struct.unpack("!i", _read_exactly(conn, 4))
            body = _read_exactly(conn, length - 4)
            (code,) = struct.unpack("!i", body[:4])
            if code in (_SSL_REQUEST, _GSSENC_REQUEST):
                conn.sendall(b"N")  # no encryption here: go on in the clear
                continue
            break  # the startup message
        conn.sendall(b"R" + struct.pack("!ii", 8, 3))  # AuthenticationCleartextPassword
        kind = _read_exactly(conn, 1)
        (length,) = struct.unpack("!i", _read_exactly(conn, 4))
        password = _read_exactly(conn, length - 4)
        if kind == b"p":
            self.passwords.append(password.rstrip(b"\0"))
        conn.sendall(_error_response("28P01", 'password authentication failed for user "app"'))

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        self._thread.join(timeout=5)


@pytest.fixture
def fake_server() -> Iterator[FakeServer]:
    server = FakeServer()
    yield server
    server.close()


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port  # closed again: nothing listens there


COMMANDS = [
    ["status"],
    ["dead", "list"],
    ["migrate"],
    ["purge", "--published-older-than", "7d", "--yes"],
]


@pytest.fixture
def startup(cli: Cli) -> float:
    """Seconds the same command takes in this mode when it fails before connecting (an unknown
    store option): the interpreter's start (in a subprocess) and the first import of psycopg
    (on a loaded machine, seconds) are not the connection's to spend, so the limit is counted
    from there."""
    url = f"postgresql://app:{ENCODED}@127.0.0.1:{_closed_port()}/app"
    started = time.monotonic()
    baseline = cli("status", "--store", url, "-o", "no_such_option=1")
    assert baseline.code == 2 and "no_such_option" in baseline.stderr, baseline
    return time.monotonic() - started


def _one_line_exit_2(result: object, port: int, started: float, startup: float, mode: str) -> str:
    elapsed = time.monotonic() - started
    code, stdout, stderr = (getattr(result, n) for n in ("code", "stdout", "stderr"))
    assert code == 2, result
    limit = LIMIT if mode == "runner" else PROCESS_LIMIT
    assert elapsed - startup < limit, f"{elapsed:.2f} s ({startup:.2f} s to start): {result}"
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, result
    assert f"127.0.0.1:{port}/app" in lines[0], result
    assert PASSWORD not in stdout + stderr and ENCODED not in stdout + stderr, result
    assert "error connecting" not in stderr, result
    return lines[0]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: "-".join(c[:2]))
def test_a_closed_port_is_one_line_exit_2_at_once(
    cli: Cli, startup: float, command: list[str]
) -> None:
    port = _closed_port()
    url = f"postgresql://app:{ENCODED}@127.0.0.1:{port}/app"
    started = time.monotonic()
    result = cli(*command, "--store", url)
    line = _one_line_exit_2(result, port, started, startup, cli.mode)
    assert "Connection refused" in line, result


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: "-".join(c[:2]))
def test_a_wrong_password_is_one_line_exit_2_at_once(
    cli: Cli, startup: float, fake_server: FakeServer, command: list[str]
) -> None:
    url = f"postgresql://app:{ENCODED}@127.0.0.1:{fake_server.port}/app"
    started = time.monotonic()
    result = cli(*command, "--store", url)
    line = _one_line_exit_2(result, fake_server.port, started, startup, cli.mode)
    assert "password authentication failed" in line, result
    assert fake_server.passwords == [PASSWORD.encode()]  # sent once, and never shown
