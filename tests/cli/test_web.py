"""``outboxkit web`` as an operator starts it: the address and a generated token printed once,
127.0.0.1, actions refused without the token or from a foreign Host, nothing created, Ctrl-C
stops it. (The pages themselves are driven in a browser by ``tests/web``.)"""

from __future__ import annotations

import re
import signal
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from outboxkit import open_store

from .conftest import Cli, Procs, wait_for


def _request(url: str, *, host: str | None = None, data: bytes | None = None) -> int:
    request = urllib.request.Request(url, data=data)
    if host is not None:
        request.add_header("Host", host)
    if data is not None:
        request.add_header("Origin", "/".join(url.split("/", 3)[:3]))
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.parametrize(
    ("stop_with", "sigint_ignored"),
    [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGINT, True)],
    ids=["ctrl-c", "sigterm", "ctrl-c-though-inherited-ignored"],
)
def test_web_serves_on_localhost_and_guards_its_actions(
    process_cli: Cli, procs: Procs, tmp_path: Path, stop_with: int, sigint_ignored: bool
) -> None:
    db = tmp_path / "ops.db"
    store = open_store(f"sqlite:///{db}")
    store.close()
    proc = procs.start(
        process_cli,
        ["web", "--store", f"sqlite:///{db}", "--port", "0"],
        sigint_ignored=sigint_ignored,
    )
    wait_for(lambda: "sign-in token" in proc.stdout() or proc.popen.poll() is not None, "start")
    out = proc.stdout()
    (origin,) = re.findall(r"outboxkit dashboard on (http://127\.0\.0\.1:\d+)/", out)
    (token,) = re.findall(r"sign-in token \(shown only now\): (\S+)", out)
    assert len(token) >= 24
    assert _request(f"{origin}/") == 200
    assert _request(f"{origin}/", host="evil.example") == 421  # DNS rebinding: refused
    assert _request(f"{origin}/login", data=b"token=wrong-token") == 403
    assert _request(f"{origin}/events/1/requeue", data=b"") == 403  # no session
    # The right token signs in (a redirect to the overview, with the session's cookie).
    assert _request(f"{origin}/login", data=f"token={token}".encode()) == 200
    proc.popen.send_signal(stop_with)
    assert proc.popen.wait(timeout=30) == 0, proc.report()
    assert "stopped" in proc.stdout()
    assert token not in proc.stderr()
    assert proc.stdout().count(token) == 1


def test_web_refuses_a_short_token_and_a_missing_database(process_cli: Cli, tmp_path: Path) -> None:
    token = "short"
    missing = tmp_path / "missing.db"
    result = process_cli("web", "--store", f"sqlite:///{missing}")
    assert result.code == 2, result
    assert "there is no SQLite database" in result.stderr
    assert not missing.exists()
    db = tmp_path / "ops.db"
    open_store(f"sqlite:///{db}").close()
    short = process_cli("web", "--store", f"sqlite:///{db}", "--token", token)
    assert short.code == 2, short
    assert "at least 8 characters" in short.stderr
    assert token not in short.stdout
