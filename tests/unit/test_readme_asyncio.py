"""The README's asyncio section runs as written: the FastAPI app with its async handler
(``orders.py``), the worker (``worker.py``) and the tests (``test_orders.py``, under the
section's ini) - every Python block of the section, on the memory store it shows."""

from __future__ import annotations

import asyncio
import importlib
import json
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from outboxkit import ObserverEvent, Published, hookimpl
from tests.docs import blocks, page, python_blocks

SECTION = page("how-to/asyncio.md")
BLOCKS = python_blocks(SECTION)
INI = blocks(SECTION, "ini")


def named(code: str) -> str:
    """The file a block is (its first line: ``# name.py ...``)."""
    return code.splitlines()[0].split()[1]


def block(name: str) -> str:
    (found,) = [b for b in BLOCKS if named(b) == name]
    return found


def test_every_python_block_of_the_section_is_run_here() -> None:
    assert [named(b) for b in BLOCKS] == [
        "orders.py",
        "worker.py",
        "test_orders.py",
    ]
    assert len(INI) == 1


def test_the_sections_tests_pass(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(orders=block("orders.py"), test_orders=block("test_orders.py"))
    # The section's ini as shown, warnings made errors (an unawaited coroutine, an unclosed
    # loop or client would fail the run).
    pytester.makefile(".ini", pytest=INI[0] + "filterwarnings = error\n")
    pytester.syspathinsert()
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


@pytest.fixture
def orders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """``orders.py`` imported from a folder of its own, its mail API faked (no network)."""
    (tmp_path / "orders.py").write_text(block("orders.py"), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    sys.modules.pop("orders", None)
    module = importlib.import_module("orders")
    try:
        yield module
    finally:
        sys.modules.pop("orders", None)


def test_the_sections_worker_delivers_until_sigterm(
    orders: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[Any] = []

    def respond(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(202)

    transport = httpx.MockTransport(respond)
    monkeypatch.setattr(
        orders, "mail_api", httpx.AsyncClient(base_url="https://x.example", transport=transport)
    )
    with orders.store.transaction() as tx:
        event_id = orders.outbox.enqueue(tx, "order.placed", {"order_id": 1, "email": "a@b.c"})

    class StopOnPublish:
        """Sends this process the SIGTERM an operator would, once the event is published: the
        worker's own signal handler stops the poller."""

        @hookimpl
        def outboxkit_on_event(self, event: ObserverEvent) -> None:
            if isinstance(event, Published):
                signal.raise_signal(signal.SIGTERM)

    orders.outbox.add_observer(StopOnPublish())
    worker: dict[str, Any] = {"__name__": "readme_worker"}
    exec(compile(block("worker.py"), "README.md", "exec"), worker)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        asyncio.run(asyncio.wait_for(worker["main"](), timeout=30))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert worker["poller"].concurrency == 8 and worker["poller"].stopping
    assert sent == [{"to": "a@b.c", "order_id": 1}]
    event = orders.store.get(event_id)
    assert event is not None and event.published_at is not None


def test_the_sections_run_command_delivers(
    orders: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The section's ``bash`` command, run until idle instead of until a signal."""
    from click.testing import CliRunner

    from outboxkit.cli import cli

    (command,) = blocks(SECTION, "bash")
    program, *args = command.split()
    assert program == "outboxkit" and args == ["run", "orders:outbox", "--concurrency", "8"]
    sent: list[Any] = []

    def respond(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(202)

    monkeypatch.setattr(
        orders,
        "mail_api",
        httpx.AsyncClient(base_url="https://x.example", transport=httpx.MockTransport(respond)),
    )
    with orders.store.transaction() as tx:
        event_id = orders.outbox.enqueue(tx, "order.placed", {"order_id": 2, "email": "d@e.f"})
    result = CliRunner().invoke(cli, [*args, "--until-idle"], prog_name="outboxkit")
    assert result.exit_code == 0, result.output
    assert "with AsyncPoller(" in result.output and "concurrency=8" in result.output, result.output
    assert sent == [{"to": "d@e.f", "order_id": 2}]
    event = orders.store.get(event_id)
    assert event is not None and event.published_at is not None
