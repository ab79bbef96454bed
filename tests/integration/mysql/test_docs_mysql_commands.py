"""The "Writing a store" page's MariaDB conformance run: its command, from the project's root,
prints what the page shows (the declared capabilities and the counts). It is the MariaDB
store's conformance run: every test of the suite, in every mode the store declares, each in a
database of its own (``server.make_store``); a failure shows the run's output."""

from __future__ import annotations

import os
import shlex
import subprocess

from tests.cli.conftest import outboxkit_command
from tests.docs import ROOT, blocks, page

from .server import require_server

PAGE = "writing-a-store.md"


def test_the_pages_conformance_run_on_mariadb() -> None:
    require_server()
    command = blocks(page(PAGE), "bash")[1].strip()
    program, *args = shlex.split(command)
    assert program == "outboxkit" and args == [
        "conformance",
        "tests.integration.mysql.server:make_store",
    ]
    shown = blocks(page(PAGE), "text")[1].strip().splitlines()
    result = subprocess.run(
        [*outboxkit_command(), *args, "-p", "no:cacheprovider"],
        cwd=ROOT,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    printed = result.stdout.strip().splitlines()
    assert shown[0] in printed, printed[:3]  # the declared capabilities
    assert printed[-1] == shown[-1]  # the counts: the skips are the asyncio modes
