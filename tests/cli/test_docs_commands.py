"""The commands the Operations and Conformance pages show, run as written on a test app and its
store (SQLite and PostgreSQL), with the page's placeholders filled in:

- ``myapp.events:outbox`` is the test app (``tests/cli/apps.py``), seeded with events in every
  state (its asyncio twin for ``--asyncio``, on a store with an asyncio side); ``sqlite:///app.db``
  and ``postgresql://…`` are its store (a PostgreSQL URL on the PostgreSQL store only), and so
  is ``OUTBOXKIT_STORE`` for a command that names none (as the page says);
- a synopsis (``dead list [--topic T] [--since 1h | --since …] [--limit N]``) runs in its
  fullest form (every bracket taken, the first of its alternatives), once per alternative of a
  group (``(ID... | --all ...)``); ``ID`` is a dead event, ``T`` its topic, ``N`` 10;
- a command that serves until stopped runs until idle (``outboxkit run`` gets ``--until-idle``),
  or is started, answers, and is stopped by SIGTERM (``outboxkit web``, on a free port:
  ``--port 0``; ``$DASHBOARD_TOKEN`` is set); ``--metrics-port`` gets a free port too.
"""

from __future__ import annotations

import re
import shlex
import signal
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from outboxkit import Store
from tests.backends import Target
from tests.docs import blocks, page

from .apps import ASYNC_APP_SOURCE, App, Seeded, seed, write_app
from .conftest import Cli, Procs, wait_for

OPERATIONS = blocks(page("how-to/operations.md"), "bash")
CONFORMANCE = blocks(page("how-to/conformance.md"), "bash")
TOKEN = "docs-dashboard-token-0123456789"


def command_lines(block: str) -> Iterator[str]:
    """The commands of a block, comments dropped."""
    for line in block.splitlines():
        line = line.split("  #", 1)[0].strip()
        if line and not line.startswith("#"):
            yield line


def expand(synopsis: str) -> list[list[str]]:
    """A synopsis line as the concrete commands it stands for (see the module's docstring)."""

    def fullest(text: str) -> str:
        # Every bracket taken, the first of its own alternatives.
        while (inner := re.search(r"\[([^\[\]]*)\]", text)) is not None:
            text = text[: inner.start()] + inner.group(1).split(" | ")[0] + text[inner.end() :]
        return text

    group = re.search(r"\(([^()]*)\)", synopsis)
    if group is not None:  # one command per alternative of the group, the rest as it is
        return [
            words
            for alternative in group.group(1).split(" | ")
            for words in expand(synopsis[: group.start()] + alternative + synopsis[group.end() :])
        ]
    return [shlex.split(fullest(synopsis))]


def fill(words: list[str], target: Target, app: App, seeded: Seeded) -> list[str] | None:
    """The page's placeholders replaced; ``None`` for a command of another store."""
    filled: list[str] = []
    for word in words:
        if word.startswith(("sqlite:///", "postgresql://")):
            if word.startswith("postgresql://") and target.backend != "pg":
                return None
            filled.append(target.url)
            continue
        word = word.replace("myapp.events:outbox", app.spec())
        word = {"ID...": str(seeded.dead_new), "ID": str(seeded.dead_new), "T": "invoice.due"}.get(
            word, word
        )
        filled.append({"N": "10", "$DASHBOARD_TOKEN": TOKEN}.get(word, word))
    names_app = any(word.endswith(":outbox") for word in filled)
    if not names_app and target.options:  # the test store's own options, as the app has them
        filled += target.option_args()
    return filled


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def seeded(app: App, store: Store) -> Seeded:
    return seed(store, app.bus)


def test_the_run_commands(
    process_cli: Cli, app: App, target: Target, seeded: Seeded, store: Store
) -> None:
    pytest.importorskip("prometheus_client")
    asyncio_app = write_app(app.folder, ASYNC_APP_SOURCE)  # --asyncio runs async def handlers
    ran = 0
    for line in command_lines(OPERATIONS[0]):
        (words,) = expand(line)
        if "--asyncio" in words and not store.capabilities.asyncio:
            continue
        args = fill(words, target, asyncio_app if "--asyncio" in words else app, seeded)
        assert args is not None and args[0] == "outboxkit" and args[1] == "run", line
        if "--until-idle" not in args:
            args.append("--until-idle")
        if "--metrics-port" in args:
            args[args.index("--metrics-port") + 1] = str(free_port())
        result = process_cli(*args[1:], env=target.app_env())
        assert result.code == 0, f"{line}\n{result}"
        assert "drained" in result.stderr + result.stdout, f"{line}\n{result}"
        ran += 1
    assert ran == (5 if store.capabilities.asyncio else 4)
    assert set(seeded.due) <= {e.id for e in store.events() if e.published_at is not None}


def test_the_status_dead_and_doctor_commands(
    process_cli: Cli, app: App, target: Target, seeded: Seeded, store: Store
) -> None:
    commands: list[list[str]] = []
    for block in OPERATIONS[1:4]:
        for line in command_lines(block):
            commands += expand(line)
    assert len(commands) == 9, commands  # status; list, show, requeue (2), purge (2); doctor (2)
    ran = 0
    for words in commands:
        args = fill(words, target, app, seeded)
        if args is None:
            continue  # the PostgreSQL doctor line, on SQLite
        result = process_cli(*args[1:], env={**target.app_env(), "OUTBOXKIT_STORE": target.url})
        if args[1] == "doctor":  # 1 names a problem it found (the shared server may have one)
            assert result.code in (0, 1) and result.stdout.strip(), f"{args}\n{result}"
        else:
            assert result.code == 0, f"{args}\n{result}"
        assert "Traceback" not in result.stderr, result
        ran += 1
    assert ran == (9 if target.backend == "pg" else 8)
    for dead in (seeded.dead_new, seeded.dead_old):  # the synopses' fullest forms: --dry-run
        event = store.get(dead)
        assert event is not None and event.failed_at is not None


def test_the_web_commands(
    process_cli: Cli, procs: Procs, app: App, target: Target, seeded: Seeded
) -> None:
    install, *serve = command_lines(OPERATIONS[4])
    assert install == 'pip install "outboxkit[web]"'
    started = 0
    for line in serve:
        (words,) = expand(line)
        args = fill(words, target, app, seeded)
        if args is None:
            continue
        if "--port" in args:
            args[args.index("--port") + 1] = "0"
        else:
            args += ["--port", "0"]
        env = {**target.app_env(), "DASHBOARD_TOKEN": TOKEN}
        proc = procs.start(process_cli, args[1:], env=env)
        wait_for(lambda p=proc: "dashboard on" in p.stdout() or p.popen.poll() is not None, "start")  # type: ignore[misc]
        (origin,) = re.findall(r"outboxkit dashboard on (http://127\.0\.0\.1:\d+)/", proc.stdout())
        with urllib.request.urlopen(f"{origin}/", timeout=30) as response:
            assert response.status == 200
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(timeout=30) == 0, proc.report()
        if "--token" in args:
            assert TOKEN not in proc.stdout() + proc.stderr()  # a given token is never echoed
        started += 1
    assert started == (2 if target.backend == "pg" else 1)


def test_the_conformance_command(process_cli: Cli, tmp_path: Path) -> None:
    (line,) = command_lines(CONFORMANCE[0])
    comment = CONFORMANCE[0].split("#", 1)[1]
    extra = shlex.split(comment.split(":", 1)[1])  # "extra arguments go to pytest: -k claim -x"
    assert extra == ["-k", "claim", "-x"]
    package = process_cli.paths[0] / "mypkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("", encoding="utf-8")
    (package / "stores.py").write_text(
        "from outboxkit import open_store\n\n\n"
        "def make_store(tmp_path):\n"
        "    return open_store(f\"sqlite:///{tmp_path / 'events.db'}\")\n",
        encoding="utf-8",
    )
    args = shlex.split(line)
    assert args[:3] == ["outboxkit", "conformance", "mypkg.stores:make_store"]
    result = process_cli(*args[1:], *extra, "-p", "no:cacheprovider")
    assert result.code == 0, result
    summary = result.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"conformance: [1-9]\d* passed, 0 failed, \d+ skipped, 0 xfailed", summary)
