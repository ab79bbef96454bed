"""A PgBouncer in front of the PostgreSQL test server, for the tests of what a connection pooler
in transaction mode does to the store.

``running_pgbouncer(server_url)`` starts Debian's ``pgbouncer`` (``/usr/sbin/pgbouncer``, or one
on ``PATH``) on a free loopback port, with a configuration in a temporary folder: transaction
pooling, a few server connections, clients trusted, and the server reached as the test URL's
user (a password, if the URL has one, goes into the folder's ``auth_file``, mode 0600, never
on a command line). It yields a ``PgBouncer`` whose ``url()`` leads through it, and stops it by
its process id at the end (SIGTERM, then SIGKILL if it lingers), removing the folder.

PgBouncer refuses to run as root: as root it is started with ``-u`` and a user of the system
(``postgres``, else ``nobody``), which then owns the folder.

Without ``pgbouncer`` the test is skipped, naming what is missing, unless
``OUTBOXKIT_REQUIRE_PG=1`` (as in CI, whose ``.ci/run`` installs it): then it fails.

PgBouncer refuses the ``options`` startup parameter; the store's own connections send none
(they set their time zone with ``SET TimeZone``, which PgBouncer keeps per client), and the
tests' URLs have no ``options``. ``ignore_startup_parameters`` stays empty, so that a test would
see a startup parameter refused, or a session setting silently dropped.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest
from psycopg.conninfo import conninfo_to_dict

__all__ = ["PgBouncer", "pgbouncer_binary", "require_pgbouncer", "running_pgbouncer"]

START_TIMEOUT = 30.0  # seconds: the most PgBouncer may take to listen (a bound, never waited out)
STOP_TIMEOUT = 10.0


@dataclass(frozen=True)
class PgBouncer:
    """A running PgBouncer: where it listens, its process id, and the database it leads to."""

    port: int
    pid: int
    user: str
    dbname: str

    def url(self) -> str:
        """A URL through PgBouncer (no password: PgBouncer trusts its local clients)."""
        return f"postgresql://{quote(self.user, safe='')}@127.0.0.1:{self.port}/{self.dbname}"

    def server_pids(self) -> list[int]:
        """The server process ids of the connections PgBouncer holds to ``dbname`` now, from
        its admin console (``SHOW SERVERS``, ``remote_pid``): what a test terminates to cut
        them, whatever ``application_name`` their last client left set."""
        import psycopg

        with psycopg.connect(
            host="127.0.0.1", port=self.port, dbname="pgbouncer", user=self.user, autocommit=True
        ) as admin:
            # The console speaks the simple query protocol only: sent on libpq directly.
            result = admin.pgconn.exec_(b"SHOW SERVERS")
            names = [(result.fname(i) or b"").decode() for i in range(result.nfields)]
            database, pid = names.index("database"), names.index("remote_pid")
            rows = [
                [(result.get_value(row, i) or b"").decode() for i in (database, pid)]
                for row in range(result.ntuples)
            ]
        return [int(remote) for name, remote in rows if name == self.dbname and int(remote)]


def pgbouncer_binary() -> str | None:
    """Debian's ``pgbouncer``, or one on ``PATH``; None when there is none."""
    for candidate in (shutil.which("pgbouncer"), "/usr/sbin/pgbouncer"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def require_pgbouncer() -> str:
    """The ``pgbouncer`` binary; skips the test without one (fails with OUTBOXKIT_REQUIRE_PG=1)."""
    binary = pgbouncer_binary()
    if binary is not None:
        return binary
    problem = (
        "no pgbouncer binary (on PATH or /usr/sbin/pgbouncer; Debian: apt-get install pgbouncer)"
    )
    if os.environ.get("OUTBOXKIT_REQUIRE_PG") == "1":
        pytest.fail(f"OUTBOXKIT_REQUIRE_PG=1 but {problem}", pytrace=False)
    pytest.skip(problem)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _run_as() -> pwd.struct_passwd | None:
    """The user PgBouncer switches to when started as root (it refuses to run as root)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError("running as root, and there is neither a postgres nor a nobody user")


def _quoted(value: str) -> str:
    """A value of PgBouncer's ``auth_file`` (double quotes doubled)."""
    return '"' + value.replace('"', '""') + '"'


def _config(folder: Path, port: int, server: dict[str, str], pool_size: int) -> Path:
    user = server.get("user") or "postgres"
    host = server.get("host") or "127.0.0.1"
    auth = folder / "users.txt"
    auth.write_text(f"{_quoted(user)} {_quoted(server.get('password', ''))}\n", encoding="utf-8")
    config = folder / "pgbouncer.ini"
    config.write_text(
        "\n".join(
            [
                "[databases]",
                f"* = host={host} port={server.get('port') or '5432'}",
                "[pgbouncer]",
                "listen_addr = 127.0.0.1",
                f"listen_port = {port}",
                "unix_socket_dir =",
                "auth_type = trust",
                f"admin_users = {user}",
                f"auth_file = {auth}",
                "pool_mode = transaction",
                f"default_pool_size = {pool_size}",
                "max_client_conn = 200",
                "log_connections = 0",
                "log_disconnections = 0",
                "stats_period = 3600",
                "",
            ]
        ),
        encoding="utf-8",
    )
    for path in (auth, config):
        path.chmod(0o600)
    return config


@contextmanager
def running_pgbouncer(server_url: str, *, pool_size: int = 2) -> Iterator[PgBouncer]:
    """A PgBouncer in transaction mode in front of ``server_url``'s server (see the module).

    Args:
        server_url: the PostgreSQL test server's URL (its host, port, user, database and
            password, if any, are used; its ``options`` are not: PgBouncer refuses them).
        pool_size: the server connections PgBouncer keeps per user and database: the fewer,
            the more often two clients' transactions share one.

    Raises:
        RuntimeError: PgBouncer exited or did not listen within ``START_TIMEOUT`` seconds (its
            output is in the message).
    """
    binary = require_pgbouncer()
    server = {k: str(v) for k, v in conninfo_to_dict(server_url).items() if v is not None}
    folder = Path(tempfile.mkdtemp(prefix="outboxkit-pgbouncer-"))
    port = _free_port()
    config = _config(folder, port, server, pool_size)
    command = [binary]
    user = _run_as()
    if user is not None:
        for path in (folder, *folder.iterdir()):
            os.chown(path, user.pw_uid, user.pw_gid)
        command += ["-u", user.pw_name]
    command.append(str(config))
    proc = subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    output = _Output(proc, port)
    try:
        output.wait_listening()
        yield PgBouncer(
            port=port,
            pid=proc.pid,
            user=server.get("user") or "postgres",
            dbname=server.get("dbname") or "postgres",
        )
    finally:
        _stop(proc)
        output.join()
        if proc.stdout is not None:
            proc.stdout.close()
        shutil.rmtree(folder, ignore_errors=True)


class _Output:
    """PgBouncer's output (it logs there when no logfile is set), read by a thread of its own
    so that the pipe never fills up, with an event set once it says it listens."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int) -> None:
        self.text = b""
        self.listening = threading.Event()
        self.closed = threading.Event()
        self._proc = proc
        self._line = b"listening on 127.0.0.1:%d" % port
        self._thread = threading.Thread(target=self._read, name="pgbouncer-output", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        try:
            while chunk := self._proc.stdout.read1(65536):
                self.text += chunk
                if self._line in self.text:
                    self.listening.set()
        finally:
            self.closed.set()

    def wait_listening(self) -> None:
        """Until PgBouncer listens (or exits): waited on an event, with a deadline."""
        deadline = time.monotonic() + START_TIMEOUT
        while not self.listening.wait(0.1):
            if self.closed.is_set() or time.monotonic() > deadline:
                why = "exited" if self._proc.poll() is not None else "did not listen in time"
                output = self.text.decode("utf-8", "replace")
                raise RuntimeError(f"pgbouncer {why}; its output:\n{output}")

    def join(self) -> None:
        self._thread.join(STOP_TIMEOUT)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop PgBouncer by its pid: SIGTERM, then SIGKILL if it has not exited in time."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(STOP_TIMEOUT)
