"""No password in any command output, log line, exception message or process argument.

Every error path that names a PostgreSQL store is tried with a URL that carries a password (as
written, and percent-encoded): bad options, a reserved schema, a bad pool size, a bad table
prefix, a scheme typo, a malformed port, a closed port, a database or schema that does not
exist. The password appears nowhere in what the command prints, in what the Python API raises
(with its whole chain of causes), or on the command line of ``outboxkit run --processes``'s
children, which get the store through their environment instead (``/proc/PID/environ`` is the
user's own; ``/proc/PID/cmdline`` is anyone's).
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from outboxkit import OutboxError, Store, open_store
from outboxkit.core.text import redact_url
from tests.backends import Target
from tests.integration.pg.conftest import fresh_schema, pg_url

from .apps import App
from .conftest import Cli, Procs, wait_for

pytestmark = pytest.mark.pg
__all__ = ["pg_url"]  # the PostgreSQL tests' fixture

PASSWORD = "Sup3r$ecretPw"
ENCODED = "Sup3r%24ecretPw"  # as it appears in a URL


def _with_password(url: str, host_port: str | None = None, path: str | None = None) -> str:
    parts = urlsplit(url)
    netloc = f"{parts.username}:{ENCODED}@{host_port or f'{parts.hostname}:{parts.port or 5432}'}"
    return parts._replace(netloc=netloc, path=path if path is not None else parts.path).geturl()


@pytest.fixture
def secret_url(pg_url: str) -> str:
    # The test server trusts local connections: any password gets in, and none is checked.
    return _with_password(pg_url)


def _clean(text: str) -> None:
    assert PASSWORD not in text, text
    assert ENCODED not in text, text


ERROR_PATHS: list[tuple[str, dict[str, Any], list[str]]] = [
    # (id, how to change the URL, --store-option arguments)
    ("unknown-option", {}, ["-o", "bogus=1"]),
    ("reserved-schema", {}, ["-o", "schema=pg_catalog"]),
    ("bad-pool-size", {}, ["-o", "pool_min_size=0"]),
    ("bad-table-prefix", {}, ["-o", "table_prefix=bad-"]),
    ("scheme-typo", {"scheme": "postgresq"}, []),
    ("malformed-port", {"host_port": "127.0.0.1:notaport"}, ["-o", "pool_timeout=1"]),
    ("closed-port", {"host_port": "127.0.0.1:1"}, ["-o", "pool_timeout=1"]),
    ("no-such-database", {"path": "/outboxkit_no_such_db"}, ["-o", "pool_timeout=1"]),
    ("no-such-schema", {}, ["-o", "schema={schema}"]),
]


def _bad_url(url: str, change: dict[str, Any]) -> str:
    bad = _with_password(url, change.get("host_port"), change.get("path"))
    if "scheme" in change:
        bad = change["scheme"] + bad[bad.index("://") :]
    return bad


@pytest.mark.parametrize(
    ("change", "options"), [pytest.param(c, o, id=i) for i, c, o in ERROR_PATHS]
)
@pytest.mark.parametrize("command", ["status", "dead list", "migrate", "purge"])
def test_no_error_path_prints_the_password(
    cli: Cli, pg_url: str, change: dict[str, Any], options: list[str], command: str
) -> None:
    extra = ["--published-older-than", "7d", "--yes"] if command == "purge" else []
    with fresh_schema(pg_url, "oksecret") as schema:
        options = [o.format(schema=schema) for o in options]
        result = cli(*command.split(), "--store", _bad_url(pg_url, change), *options, *extra)
    creates = command == "migrate" and options == ["-o", f"schema={schema}"]
    assert (result.code == 0) == creates, result  # only migrate makes a missing schema
    _clean(result.stdout + result.stderr)


@pytest.mark.parametrize(
    ("change", "options"), [pytest.param(c, o, id=i) for i, c, o in ERROR_PATHS]
)
def test_no_exception_carries_the_password(
    pg_url: str, change: dict[str, Any], options: list[str]
) -> None:
    kwargs: dict[str, Any] = {}
    with fresh_schema(pg_url, "oksecret") as schema:
        for flag, pair in zip(options[::2], options[1::2], strict=True):
            assert flag == "-o"
            key, _, value = pair.format(schema=schema).partition("=")
            kwargs[key] = int(value) if value.isdigit() else value
        with pytest.raises(OutboxError) as info:
            store = open_store(_bad_url(pg_url, change), **kwargs)
            try:
                store.stats(now=None)
            finally:
                store.close()
    _clean("".join(traceback.format_exception(info.value)))
    _clean(repr(info.value))


def test_a_store_never_shows_its_password(secret_url: str) -> None:
    store: Store = open_store(secret_url, schema="outboxkit_never_made")
    try:
        _clean(repr(store))
        _clean(str(getattr(store, "where", "")))
    finally:
        store.close()
    assert redact_url(secret_url).count("***") == 1
    _clean(redact_url(secret_url))
    _clean(redact_url(f"host=127.0.0.1 password={PASSWORD} dbname=postgres"))
    _clean(redact_url(f"host=127.0.0.1 password='{PASSWORD}' dbname=postgres"))


def test_supervised_children_get_the_store_through_their_environment(
    process_cli: Cli, target: Target, store: Store, app: App, procs: Procs, tmp_path: Path
) -> None:
    if target.backend != "pg":
        pytest.skip("the password is PostgreSQL's")
    url = _with_password(target.url)
    supervisor = procs.start(
        process_cli,
        ["run", app.spec(), "--processes", "2", "--store", url, "--interval", "50ms"],
        env={"CLI_TEST_STORE": url},
    )
    wait_for(
        lambda: (
            len(re.findall(r"started \(pid (\d+)\)", supervisor.stderr())) >= 2
            or supervisor.popen.poll() is not None
        ),
        "two children started",
    )
    children = [int(p) for p in re.findall(r"started \(pid (\d+)\)", supervisor.stderr())]
    assert len(children) == 2, supervisor.report()
    for pid in children:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode("utf-8", "replace")
        _clean(cmdline)
        environ = Path(f"/proc/{pid}/environ").read_bytes().decode("utf-8", "replace")
        assert f"OUTBOXKIT_STORE={url}" in environ.split("\0")
    supervisor.popen.terminate()
    assert supervisor.popen.wait(timeout=30) == 0, supervisor.report()
    _clean(supervisor.stderr() + supervisor.stdout())
